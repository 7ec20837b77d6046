"""Samples/s of `examples/resnet18_cifar10_amp.yaml` on this GPU in fp32, fp16 and bf16,
the trainer against a hand-written loop, side by side in one run.

    python bench/gpu_precision.py                     # 25,600 CIFAR-format images, 4 epochs
    python bench/gpu_precision.py --train-size 51200 --epochs 3 --json out.json

For each precision:
  (a) loop     a hand-written loop: the trainer's ResNet-18 on the same GPU, the data set
               resident on the GPU as uint8, normalised per batch, channels_last, fused
               Nesterov SGD, autocast (+ GradScaler for fp16), the loss read every 10 steps;
  (b) trainer  trainer.loop.run on the example spec (its precision replaced), in this
               process, evaluation and checkpoints off so both time the same steps.
Both are timed between two synchronised points after the first epoch (cuDNN autotuning and
the first allocations excluded). Needs CUDA; writes synthetic data in CIFAR-10's format to
a temporary directory (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from trainer_vs_seed import write_cifar  # noqa: E402

from torchyard.contracts.spec import parse_spec  # noqa: E402
from torchyard.trainer.data import Normalizer, load_dataset  # noqa: E402
from torchyard.trainer.distributed import Dist  # noqa: E402
from torchyard.trainer.events import MemoryEvents  # noqa: E402
from torchyard.trainer.loop import Run, run  # noqa: E402
from torchyard.trainer.models import build_model  # noqa: E402

EXAMPLE = REPO / "examples" / "resnet18_cifar10_amp.yaml"
DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def spec_for(precision: str, epochs: int) -> dict[str, Any]:
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec.update(precision=precision, epochs=epochs, eval_every_epochs=0, log_every_steps=10)
    spec["checkpoint"] = {"every_epochs": None, "keep_last": 1}
    return spec


def trainer_rate(spec: dict[str, Any], data_root: Path, run_dir: Path) -> float:
    events = MemoryEvents()
    r = Run(run_dir=run_dir, dist=Dist(0, 0, 1, torch.device("cuda", 0)), events=events,
            data_root=data_root, log=lambda _s: None)  # fmt: skip
    code = run(parse_spec(spec), r)
    assert code == 0, events.of_type("error")
    spe = events.of_type("started")[0]["steps_per_epoch"]
    # train/loss events are written right after a host sync: their times bracket the steps.
    marks = [(e["step"], e["time"]) for e in events.of_type("metric") if e["name"] == "train/loss"]
    marks = [m for m in marks if m[0] >= spe]  # after the first epoch
    (s0, t0), (s1, t1) = marks[0], marks[-1]
    return (s1 - s0) * spec["batch_size"] / (t1 - t0)


def loop_rate(spec: dict[str, Any], data_root: Path, precision: str) -> float:
    dev = torch.device("cuda", 0)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    s = parse_spec(spec)
    ds = load_dataset(s.data, data_root, 0)
    xs, ys = (t.to(dev) for t in ds.train.tensors())
    norm = Normalizer(ds, dev)
    torch.manual_seed(0)
    net = build_model(s.model, ds.sample_shape, ds.num_classes).to(dev)
    net = net.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    o = s.optimizer
    opt = torch.optim.SGD(net.parameters(), lr=o.learning_rate, momentum=o.sgd_momentum,
                          nesterov=o.nesterov, weight_decay=o.weight_decay, fused=True)  # fmt: skip
    dtype = DTYPES[precision]
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")
    b, n = s.batch_size, len(xs)
    spe = n // b
    marks: list[tuple[int, float]] = []
    step, pending = 0, []
    for _epoch in range(s.epochs):
        order = torch.randperm(n, device=dev)
        for k in range(spe):
            idx = order[k * b : (k + 1) * b]
            x = norm(xs.index_select(0, idx)).contiguous(memory_format=torch.channels_last)
            y = ys.index_select(0, idx)
            with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
                loss = F.cross_entropy(net(x), y)
            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), s.grad_clip or 1e9)
            scaler.step(opt)
            scaler.update()
            step += 1
            pending.append(loss.detach())
            if step % 10 == 0:
                torch.stack(pending).tolist()  # the host sync the trainer also makes
                pending.clear()
                if step >= spe:
                    marks.append((step, time.time()))
    (s0, t0), (s1, t1) = marks[0], marks[-1]
    return (s1 - s0) * b / (t1 - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--train-size", type=int, default=25_600)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_cifar(root, args.train_size, 1000)
        print(f"{out['gpu']}, torch {out['torch']}, {args.train_size} images, "
              f"{args.epochs} epochs, batch 512, channels_last")  # fmt: skip
        print(f"{'precision':>9} {'loop':>10} {'trainer':>10} {'trainer/loop':>13}")
        for p in ("fp32", "fp16", "bf16"):
            spec = spec_for(p, args.epochs)
            a = loop_rate(spec, root, p)
            b = trainer_rate(spec, root, root / f"run-{p}")
            out[p] = {"loop": a, "trainer": b, "ratio": b / a}
            print(f"{p:>9} {a:10.0f} {b:10.0f} {b / a:13.3f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
