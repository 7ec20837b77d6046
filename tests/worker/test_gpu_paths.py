"""The worker's side of the GPU review (issue "right on real GPUs"), on CPU: GPU pinning
by UUID in PCI order and through an inherited CUDA_VISIBLE_DEVICES, the loopback
rendezvous address refused for a gang that spans hosts, and a failure on a rank other than
0 classified by that rank's own report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from support.worker_factories import make_job, make_worker

from torchyard.scheduler.cycle import schedule
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import Attempt, Job
from torchyard.store.states import A_FAILED, A_LOST
from torchyard.worker.events import last_rank_event
from torchyard.worker.identity import Device, GpuRow, gpu_device, is_loopback
from torchyard.worker.outcome import Ending, decide
from torchyard.worker.proc import trainer_env
from torchyard.worker.supervisor import Claimed, Supervision, WorkerContext, peer_decides_first

ROWS = [
    GpuRow(0, "GPU-aaaa", "NVIDIA A100-SXM4-80GB", 80 << 30),
    GpuRow(1, "GPU-bbbb", "Tesla T4", 16 << 30),
    GpuRow(2, "GPU-cccc", "NVIDIA A100-SXM4-80GB", 80 << 30),
    GpuRow(3, "GPU-dddd", "NVIDIA A100-SXM4-80GB", 80 << 30),
]


def test_a_gpu_is_pinned_by_uuid_in_pci_order() -> None:
    d = gpu_device(1, environ={}, smi=lambda: ROWS)
    assert (d.gpu, d.name, d.cuda_visible) == (1, "Tesla T4", "GPU-bbbb")
    env = trainer_env(data_root=Path("/d"), cuda_visible=d.cuda_visible, collective_timeout_s=30)
    # A bare index would be read fastest-first by CUDA: the trainer gets the UUID and PCI order.
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-bbbb"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["TORCHYARD_COLLECTIVE_TIMEOUT_S"] == "30"


def test_gpu_n_counts_an_inherited_cuda_visible_devices() -> None:
    # Slurm gave this worker GPUs 2 and 3: --gpu 1 is GPU 3, never the host's GPU 1.
    d = gpu_device(1, environ={"CUDA_VISIBLE_DEVICES": "2,3"}, smi=lambda: ROWS)
    assert d.cuda_visible == "GPU-dddd"
    d = gpu_device(0, environ={"CUDA_VISIBLE_DEVICES": "GPU-cccc"}, smi=lambda: ROWS)
    assert (d.cuda_visible, d.name) == ("GPU-cccc", "NVIDIA A100-SXM4-80GB")
    # MIG instances are named by UUID and passed on as they are.
    mig = "MIG-0f3e1d2c-aaaa-bbbb-cccc-000000000001"
    d = gpu_device(0, environ={"CUDA_VISIBLE_DEVICES": mig}, smi=lambda: ROWS)
    assert d.cuda_visible == mig and d.kind == "cuda"
    with pytest.raises(ValueError, match="lists 2 GPU"):
        gpu_device(2, environ={"CUDA_VISIBLE_DEVICES": "2,3"}, smi=lambda: ROWS)
    with pytest.raises(ValueError, match="lists no GPU 7"):
        gpu_device(7, environ={}, smi=lambda: ROWS)
    # No nvidia-smi: the index is passed on (in PCI order) rather than refused.
    assert gpu_device(0, environ={}, smi=lambda: None).cuda_visible == "0"
    assert Device("cpu", None, "cpu", None).cuda_visible == ""


def test_loopback_addresses() -> None:
    for a in ("127.0.0.1", "127.0.1.1", "::1", "localhost"):
        assert is_loopback(a), a
    for a in ("10.0.0.5", "gpuhost1", "192.168.1.20"):
        assert not is_loopback(a), a


def _settings(db_url: str, tmp_path: Path) -> Settings:
    return Settings(_env_file=None, database_url=db_url, home=tmp_path)  # type: ignore[call-arg]


def test_a_loopback_rendezvous_address_is_refused_for_ranks_on_two_hosts(
    db_url: str, tmp_path: Path
) -> None:
    """Debian maps the host name to 127.0.1.1: rank 1 on another host would wait for it
    until the rendezvous timed out. The attempt fails at once, naming the setting."""
    with session_scope(db_url) as s:
        make_worker(s, "a", host="gpuhost1")
        make_worker(s, "b", host="gpuhost2")
        job = make_job(s, world_size=2)
        dispatches = schedule(s, heartbeat_timeout_s=10)
        rank0 = next(d for d in dispatches if d.rank == 0)
        attempt = s.scalars(select(Attempt).where(Attempt.job_id == job.id)).one()
        claimed = Claimed(rank0.assignment_id, attempt.id, 1, job.id, 0, 2, dict(job.spec), False)
        job_id = job.id
    ctx = WorkerContext(
        _settings(db_url, tmp_path), rank0.worker_id, Device("cpu", None, "cpu", None), "127.0.1.1"
    )
    Supervision(ctx, claimed).run()
    with session_scope(db_url) as s:
        a = s.scalars(select(Attempt).where(Attempt.job_id == job_id)).one()
        assert a.state == A_FAILED
        assert "TORCHYARD_ADVERTISE_ADDR" in (a.reason or "")
        assert "127.0.1.1" in (a.reason or "") and "gpuhost2" in (a.reason or "")
        j = s.get(Job, job_id)
        assert j is not None and j.state == "queued"  # counted, retried on another gang


def _ending(**kw: Any) -> Ending:
    base: dict[str, Any] = dict(rc=1, rank=1, worker_id="w1", stop_why=None, job_state="running")
    return Ending(**(base | kw))


def test_a_rank_that_fails_alone_is_classified_by_its_own_report(tmp_path: Path) -> None:
    # Rank 1's trainer writes its error to its own file; its worker reads this attempt's.
    f = tmp_path / "events.rank1.jsonl"
    old = {"type": "error", "kind": "internal", "message": "old", "attempt": 1}
    f.write_text(json.dumps(old) + "\n")
    start = f.stat().st_size
    mine = {"type": "error", "kind": "data", "message": "mnist: no such file", "attempt": 2}
    with f.open("a") as fh:
        fh.write(json.dumps(mine) + "\n" + '{"type": "err')  # torn last line
    assert last_rank_event(f, start, 2) == mine
    assert last_rank_event(f, 0, 1) == old
    assert last_rank_event(tmp_path / "missing.jsonl", 0, 2) is None

    d = decide(_ending(error=mine))
    assert d is not None and d.outcome == A_FAILED and not d.retryable
    assert d.reason.startswith("rank 1: data: mnist")
    assert not peer_decides_first(_ending(error=mine), d, 2)
    oom = decide(_ending(error={"kind": "out_of_memory", "message": "CUDA out of memory"}))
    assert oom is not None and oom.outcome == A_FAILED and not oom.retryable
    # The victims: a rank whose peer died waits for the peer's worker, then counts as lost.
    peer = _ending(rank=0, error={"kind": "peer_failed", "message": "Connection closed"})
    dp = decide(peer)
    assert dp is not None and dp.outcome == A_LOST and dp.retryable
    assert peer_decides_first(peer, dp, 2)
    silent = _ending(rank=1)  # no report of its own: rank 0 decides first
    ds = decide(silent)
    assert ds is not None and peer_decides_first(silent, ds, 2)
    # Stopped at a checkpoint its own worker did not ask for: a peer's worker stopped the
    # gang (a scancel of that host) and decides; with no peer the stop is the job's doing.
    stopped = _ending(rank=0, rc=1, stopped=True, last_step=55)
    dst = decide(stopped)
    assert dst is not None and dst.outcome == A_FAILED
    assert peer_decides_first(stopped, dst, 2)
    assert not peer_decides_first(stopped, dst, 1)
    asked = _ending(rank=0, rc=75, stopped=True, stop_why="stopping")
    da = decide(asked)
    assert da is not None and not peer_decides_first(asked, da, 2)
