"""Helpers for the trainer's tests (imported by name: tests/trainer is on sys.path): specs with keyword defaults, in-process runs, real
`python -m torchyard.trainer` / torchrun subprocesses, and small data sets in torchvision's formats."""

from __future__ import annotations

import gzip
import json
import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from specs import digits_spec

REPO = Path(__file__).resolve().parents[2]


make_spec = digits_spec  # the trainer tests' name for it


def write_spec(path: Path, spec: dict[str, Any]) -> Path:
    path.write_text(json.dumps(spec))
    return path


def trainer_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def trainer_cmd(spec_path: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torchyard.trainer",
        "--spec",
        str(spec_path),
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def run_trainer(spec_path: Path, run_dir: Path, *extra: str, timeout: float = 120, **env: str):
    return subprocess.run(
        trainer_cmd(spec_path, run_dir, *extra),
        env=trainer_env(**env),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    from torchyard.trainer.events import read_events as _read

    return _read(run_dir / "events.jsonl")


def wait_for_event(run_dir: Path, pred, proc: subprocess.Popen, timeout: float = 60) -> dict:
    """Poll events.jsonl until an event satisfies `pred` (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    path = run_dir / "events.jsonl"
    while time.monotonic() < deadline:
        if path.exists():
            for e in read_events(run_dir):
                if pred(e):
                    return e
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) before the event came")
        time.sleep(0.005)
    raise AssertionError("timed out waiting for an event")


def load_weights(run_dir: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "model.safetensors"))


# ---------------------------------------------------------------- data sets on disk


def _idx_bytes(arr: np.ndarray) -> bytes:
    header = bytes([0, 0, 0x08, arr.ndim]) + b"".join(d.to_bytes(4, "big") for d in arr.shape)
    return header + arr.astype(np.uint8).tobytes()


def write_mnist(root: Path, n_train: int, n_test: int, folder: str = "MNIST", gz: bool = False):
    """MNIST-format idx files of learnable synthetic images (class = bright quadrant)."""
    rng = np.random.default_rng(0)
    raw = root / folder / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        y = rng.integers(0, 10, n).astype(np.uint8)
        x = rng.integers(0, 60, (n, 28, 28)).astype(np.uint8)
        for i, c in enumerate(y):
            r, col = divmod(int(c), 5)
            x[i, r * 14 : r * 14 + 14, col * 5 : col * 5 + 5] += 150
        for kind, arr in (("images-idx3", x), ("labels-idx1", y)):
            name = f"{prefix}-{kind}-ubyte"
            data = _idx_bytes(arr)
            if gz:
                (raw / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (raw / name).write_bytes(data)
    return root


def write_cifar(root: Path, per_batch: int, n_test: int) -> Path:
    """CIFAR-10 python batches (pickled dicts of numpy arrays), learnable: class = colour."""
    rng = np.random.default_rng(1)
    d = root / "cifar-10-batches-py"
    d.mkdir(parents=True, exist_ok=True)

    def batch(n: int, str_keys: bool = False) -> dict:
        y = rng.integers(0, 10, n)
        x = rng.integers(0, 80, (n, 3, 32, 32)).astype(np.uint8)
        for i, c in enumerate(y):
            x[i, int(c) % 3] += 60 + 15 * (int(c) // 3)
        # bytes keys as in the original (Python 2) files; str keys as Python 3 writes them
        keys = ("data", "labels") if str_keys else (b"data", b"labels")
        return {keys[0]: x.reshape(n, 3072), keys[1]: [int(v) for v in y]}

    for i in range(1, 6):
        (d / f"data_batch_{i}").write_bytes(pickle.dumps(batch(per_batch)))
    (d / "test_batch").write_bytes(pickle.dumps(batch(n_test, str_keys=True)))
    (d / "batches.meta").write_bytes(
        pickle.dumps({b"label_names": [b"c%d" % i for i in range(10)]})
    )
    return root


def train_in_process(
    spec: dict[str, Any],
    run_dir: Path,
    data_root: Path | None = None,
    resume: Path | None = None,
    device: str = "cpu",
    init: Path | None = None,
):
    """Run the training loop in this process (CPU unless told), events kept in memory:
    (exit code, events)."""
    import torch

    from torchyard.contracts.spec import parse_spec
    from torchyard.trainer.distributed import Dist
    from torchyard.trainer.events import MemoryEvents
    from torchyard.trainer.loop import Run, run

    run_dir.mkdir(parents=True, exist_ok=True)
    events = MemoryEvents()
    r = Run(
        run_dir=run_dir,
        dist=Dist(rank=0, local_rank=0, world_size=1, device=torch.device(device)),
        events=events,
        data_root=data_root or run_dir / "no-data",
        resume=resume,
        log=lambda _s: None,
        init=init,
    )
    return run(parse_spec(spec), r), events


def start_gang(
    spec_path: Path,
    run_dir: Path,
    world: int = 2,
    *,
    devices: list[str] | None = None,
    data_roots: list[Path] | None = None,
    resume: Path | None = None,
    stdout: Any = subprocess.DEVNULL,
    **env: str,
) -> list[subprocess.Popen]:
    """One DDP job exactly as the workers launch it (worker/proc.py): one torchrun per rank
    with `--nnodes=world --nproc-per-node=1`, so LOCAL_RANK is 0 everywhere, each pinned
    with its own CUDA_VISIBLE_DEVICES (`devices[i]`; "" for CPU) and data root."""
    from torchyard.worker.proc import Launch, trainer_argv
    from torchyard.worker.proc import trainer_env as worker_env

    port = free_port()
    procs = []
    for rank in range(world):
        launch = Launch(spec_path, run_dir, resume, world, rank, "127.0.0.1", port)
        e = worker_env(
            data_root=(
                data_roots[rank] if data_roots else Path(env.get("TORCHYARD_DATA_ROOT", "."))
            ),
            cuda_visible=devices[rank] if devices else "",
            attempt=1,
            collective_timeout_s=float(env.pop("COLLECTIVE_TIMEOUT_S", "120")),
        )
        e.update(env)
        procs.append(subprocess.Popen(trainer_argv(launch), env=e, cwd=REPO, stdout=stdout,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str]]:
    """(exit code, stderr) of each process, killing every one if any overruns."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out
