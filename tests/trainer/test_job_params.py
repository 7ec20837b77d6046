"""`job.params()`: under torchyard the spec's `params` (a copy each call, {} when none), the
same in a process the script starts (TORCHYARD_PARAMS, restored after the run), and the
job's log names them; by hand TORCHYARD_PARAMS or {}. All in this process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchyard import job
from torchyard.contracts import exitcodes
from torchyard.contracts.spec import parse_spec
from torchyard.trainer.distributed import Dist
from torchyard.trainer.events import MemoryEvents
from torchyard.trainer.loop import Run
from torchyard.trainer.script import run_script
from torchyard.trainer.signals import StopFlag

SCRIPT = """\
import json, os
from pathlib import Path
from torchyard import job
p = job.params()
p["lr"] = "changed"  # a copy: the next call is unchanged
(job.setup().run_dir / "out.json").write_text(json.dumps([job.params(), os.environ["TORCHYARD_PARAMS"]]))
"""


def _run(tmp_path: Path, params: dict | None) -> tuple[int, list, list[str]]:
    bundle = tmp_path / "bundle"
    bundle.mkdir(exist_ok=True)
    (bundle / "train.py").write_text(SCRIPT)
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    lines: list[str] = []
    r = Run(run_dir=run_dir, dist=Dist(rank=0, local_rank=0, world_size=1,
            device=torch.device("cpu")), events=MemoryEvents(), data_root=tmp_path,
            resume=None, stop=StopFlag(), log=lines.append)  # fmt: skip
    spec = {"code": {"bundle": "0" * 64}, "entrypoint": {"script": "train.py"}}
    if params is not None:
        spec["params"] = params
    code = run_script(parse_spec(spec), r, bundle)
    return code, json.loads((run_dir / "out.json").read_text()), lines


def test_a_script_reads_the_specs_params(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(job.PARAMS_ENV, '{"lr": "from the worker"}')
    params = {"lr": 0.1, "arch": "wide", "layers": 3, "bn": True}
    code, (got, env), lines = _run(tmp_path, params)
    assert code == exitcodes.OK
    assert got == params and json.loads(env) == params
    assert "params: lr=0.1, arch='wide', layers=3, bn=True" in lines
    assert job.params_from_env() == {"lr": "from the worker"}  # restored after the run
    code, (got, env), _ = _run(tmp_path, None)
    assert code == exitcodes.OK and got == {} and env == "{}"


def test_by_hand_params_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(job.PARAMS_ENV, raising=False)
    job._install(None)
    assert job.params() == {}
    monkeypatch.setenv(job.PARAMS_ENV, '{"lr": 0.5, "arch": "wide"}')
    first = job.params()
    first["lr"] = 9
    assert job.params() == {"lr": 0.5, "arch": "wide"}
    for bad, why in (("[1]", "not list"), ("{lr: 1}", "JSON object")):
        monkeypatch.setenv(job.PARAMS_ENV, bad)
        with pytest.raises(ValueError, match=rf"TORCHYARD_PARAMS must hold a .*{why}"):
            job.params()
