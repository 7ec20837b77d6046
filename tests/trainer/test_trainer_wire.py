"""Ranks exchange data through tensor collectives only: no `*_object*` collective (they
unpickle what a peer sends) anywhere in trainer/, a pickle-free encoding that round-trips
RNG states exactly, and the gather itself across two real gloo ranks."""

from __future__ import annotations

import io
import math
import pickle
import subprocess
import sys
import tokenize
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from trainer_testlib import REPO, free_port, trainer_env

from torchyard.trainer import wire
from torchyard.trainer.checkpoint import capture_rng

# Every pickling collective torch has (and those older or newer versions may add).
PICKLING = {n for n in dir(dist) if "_object" in n} | {
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
}


def pickling_collectives(source: str) -> list[str]:
    """Names and strings of the source that mention a pickling collective (a string too:
    `getattr(dist, "all_gather_object")` is the same call)."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.NAME, tokenize.STRING):
            found += [f"{tok.start[0]}: {n}" for n in sorted(PICKLING) if n in tok.string]
    return found


def test_the_scan_catches_each_way_of_calling_them() -> None:
    assert "all_gather_object" in PICKLING and "broadcast_object_list" in PICKLING
    planted = [
        "dist.all_gather_object(out, obj)",
        "from torch.distributed import broadcast_object_list as b",
        "getattr(dist, 'scatter_object_list')(a, b)",
        "torch.distributed.gather_object(x)",
    ]
    for line in planted:
        assert pickling_collectives(line), line
    # a comment is not a call; ordinary names that merely contain "object" are not either
    assert not pickling_collectives("# never all_gather_object here\nx = object()\n")


def test_no_pickling_collective_in_the_trainer() -> None:
    files = sorted((REPO / "trainer").rglob("*.py"))
    assert len(files) > 10 and REPO / "trainer" / "distributed.py" in files
    hits = {
        str(f.relative_to(REPO)): found
        for f in files
        if (found := pickling_collectives(f.read_text(encoding="utf-8")))
    }
    assert hits == {}


def same(a: Any, b: Any) -> bool:
    """Equal values of equal types; tensors equal bitwise, with the same dtype and shape."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return (
            isinstance(b, list)
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
        )
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b and str(a) == str(b)  # str: -0.0 is not 0.0


def test_rng_states_and_odd_values_round_trip_exactly() -> None:
    torch.manual_seed(3)
    value = {
        "rng": capture_rng(torch.device("cpu")),
        "tensors": [
            torch.randn(3, 4, dtype=torch.float64),
            torch.randn(5).to(torch.bfloat16),
            torch.tensor([True, False]),
            torch.tensor(7, dtype=torch.int32),  # 0-dim
            torch.empty(0, 3, dtype=torch.float16),
            torch.arange(12).reshape(3, 4).t(),  # not contiguous
        ],
        "plain": [None, True, 0, -(2**70), 0.1, -0.0, math.inf, math.nan, "é", [], {}],
    }
    assert isinstance(value["rng"]["python"]["gauss"], float | None)
    back = wire.decode(wire.encode(value))
    assert same(value, back)
    # and `same` is strict enough to tell what a lossy encoding would blur
    assert not same(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))
    assert not same([0.0], [-0.0]) and not same([1], [True]) and not same([1], [1.0])


@pytest.mark.parametrize(
    "bad",
    [
        {"s": {1, 2}},  # not a JSON type
        {1: "int key"},
        {wire.TENSOR_KEY: "would decode as a tensor"},
        torch.tensor([1 + 2j]),  # dtype outside the allowed list
    ],
)
def test_encode_refuses_what_it_cannot_carry(bad: Any) -> None:
    with pytest.raises(TypeError):
        wire.encode(bad)


def _frame(header: bytes, body: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + body


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x05\x00",
        _frame(b'{"a":1}')[:-1],  # truncated header
        _frame(b"not json"),
        _frame(b'{"__tensor__":["object",[1],0,8]}', bytes(8)),  # dtype not allowed
        _frame(b'{"__tensor__":["int64",[2],0,16]}', bytes(8)),  # past the end of the data
        _frame(b'{"__tensor__":["int64",[2],0,8]}', bytes(16)),  # nbytes does not match shape
        _frame(b'{"__tensor__":["int64",[-1],0,0]}'),
        _frame(b'{"__tensor__":"x"}'),
        pickle.dumps({"rng": torch.zeros(2)}),  # a pickle is never decoded as one
    ],
)
def test_decode_refuses_malformed_bytes(data: bytes) -> None:
    with pytest.raises(wire.WireError):
        wire.decode(data)


# Each rank gathers its own RNG state plus a payload of a rank-dependent length (the padding
# path), and checks every rank's entry against what that rank must have sent.
RANK_SCRIPT = """
import random, sys
import numpy as np
import torch
from torchyard.trainer import distributed
from torchyard.trainer.checkpoint import capture_rng
sys.path[:0] = [{tests!r}, {shared!r}]  # this folder and tests/ (specs.py)
from test_trainer_wire import same

def payload(rank):
    torch.manual_seed(100 + rank); np.random.seed(100 + rank); random.seed(100 + rank)
    random.gauss(0, 1)  # a cached gaussian: python's gauss becomes a float
    return {{"rng": capture_rng(torch.device("cpu")), "rank": rank,
            "extra": torch.arange(1000 * rank, dtype=torch.int16), "none": None}}

d = distributed.setup()
assert d.world_size == 2 and d.device.type == "cpu"
mine = payload(d.rank)
got = distributed.gather_to_main(d, mine)
assert len(got) == 2, got
for r in range(2):
    assert same(got[r], payload(r)), r
assert same(got[d.rank], mine)
assert distributed.all_gather_bytes(d, b"x" * (3 * d.rank)) == [b"", b"xxx"]
assert distributed.all_gather_bytes(d, b"") == [b"", b""]
distributed.teardown(d)
print("ok", d.rank, flush=True)
"""


@pytest.mark.e2e
def test_gather_to_main_over_two_gloo_ranks(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    here = Path(__file__).parent
    script.write_text(RANK_SCRIPT.format(tests=str(here), shared=str(here.parent)))
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            cwd=REPO,
            env=trainer_env(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                CUDA_VISIBLE_DEVICES="",
                OMP_NUM_THREADS="1",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=120))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, err[-4000:]
        assert out.strip() == f"ok {rank}"
