"""Small parts of the worker and scheduler, in-process: ids and slot locks, the trainer's
argv and environment, and the reconciler (lost assignment messages re-sent, assignments
of workers that went away handed back)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import update
from worker_factories import make_job, make_worker

from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import Assignment, Attempt, Job, Worker, utcnow
from torchyard.worker.identity import SlotTaken, claim_id
from torchyard.worker.proc import Launch, trainer_argv, trainer_env
from torchyard.worker.scheduler import Scheduler


def test_worker_ids_are_stable_and_exclusive(tmp_path: Path) -> None:
    a, lock_a = claim_id(tmp_path, name=None, gpu=None)
    b, lock_b = claim_id(tmp_path, name=None, gpu=None)
    assert a.endswith("-cpu0") and b.endswith("-cpu1")
    g, lock_g = claim_id(tmp_path, name=None, gpu=3)
    assert g.endswith("-gpu3")
    with pytest.raises(SlotTaken):
        claim_id(tmp_path, name=None, gpu=3)  # one worker per GPU per host
    lock_a.close()  # the process holding cpu0 is gone: a new one takes its id back
    again, _ = claim_id(tmp_path, name=None, gpu=None)
    assert again == a
    with pytest.raises(ValueError):
        claim_id(tmp_path, name="../../etc", gpu=None)
    lock_b.close()
    lock_g.close()


def test_trainer_argv_is_a_list_and_ddp_uses_torchrun(tmp_path: Path) -> None:
    one = trainer_argv(
        Launch(spec_path=tmp_path / "s.json", run_dir=tmp_path, resume=tmp_path / "c.pt")
    )
    assert one[1:3] == ["-m", "torchyard.trainer"] and one[-2:] == [
        "--resume",
        str(tmp_path / "c.pt"),
    ]
    ddp = trainer_argv(
        Launch(
            spec_path=tmp_path / "s.json",
            run_dir=tmp_path,
            world_size=2,
            rank=1,
            master_addr="10.0.0.5",
            master_port=29511,
        )
    )
    assert ddp[1:3] == ["-m", "torch.distributed.run"]
    for flag in (
        "--nnodes=2",
        "--node-rank=1",
        "--nproc-per-node=1",
        "--master-addr=10.0.0.5",
        "--master-port=29511",
    ):
        assert flag in ddp
    assert ddp[ddp.index("-m", 3) + 1] == "torchyard.trainer"


def test_trainer_env_pins_the_device_and_drops_secrets(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", "postgresql://u:secret@db/x")
    cpu = trainer_env(data_root=tmp_path, cuda_visible="")
    assert cpu["CUDA_VISIBLE_DEVICES"] == ""  # a CPU slot sees no GPU
    assert cpu["TORCHYARD_DATA_ROOT"] == str(tmp_path)
    assert cpu["TORCHYARD_DIE_WITH_PARENT"] == "1" and cpu["PYTHONUNBUFFERED"] == "1"
    assert "TORCHYARD_DATABASE_URL" not in cpu
    assert trainer_env(data_root=tmp_path, cuda_visible="2")["CUDA_VISIBLE_DEVICES"] == "2"


class _Sent(Scheduler):
    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.sent: list[tuple[int, str]] = []

    def _send(self, assignment_id: int, queue: str) -> bool:
        self.sent.append((assignment_id, queue))
        return True


def test_reconciler_resends_lost_messages_and_hands_back_gone_workers(
    sqlite_url: str, tmp_path: Path
) -> None:
    settings = Settings(_env_file=None, database_url=sqlite_url, home=tmp_path)  # type: ignore[call-arg]
    sched = _Sent(settings)
    with session_scope(sqlite_url) as s:
        make_worker(s, "w1")
        make_worker(s, "w2")
        a = make_job(s, name="a")
        b = make_job(s, name="b", age_s=-1)
    assert len(sched.schedule_pass()) == 2
    assert len(sched.sent) == 2
    sched.sent.clear()
    with session_scope(sqlite_url) as s:
        # Both messages were lost; w2 then stopped before taking its assignment.
        old = utcnow() - timedelta(seconds=10)  # past the re-send delay, not the claim deadline
        s.execute(update(Assignment).values(created_at=old))
        s.execute(update(Worker).where(Worker.id == "w2").values(state="stopped"))
        on_w2 = s.query(Assignment).filter_by(worker_id="w2").one().job_id
    assert sched.reconcile() == 1
    assert [q for _, q in sched.sent] == ["q.w1"]
    assert sched.reconcile() == 0  # not again right away
    with session_scope(sqlite_url) as s:
        j = s.get(Job, on_w2)
        assert j is not None and j.state == "queued" and j.attempt == 2
        assert "went away" in (j.pending_reason or "")
        assert {a.id, b.id} >= {on_w2}


def test_claim_deadline_gives_the_job_to_another_worker(sqlite_url: str, tmp_path: Path) -> None:
    """A worker whose consumer hangs (heartbeat alive, message never taken) used to keep its
    job `starting` forever while the reconciler re-sent. Past the claim deadline the attempt
    is handed back (not counted), the job starts on another worker, and the silent worker
    is lost until it registers again."""
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None,
        database_url=sqlite_url,
        home=tmp_path,
        claim_timeout_s=5,
        heartbeat_interval_s=0.1,
        heartbeat_timeout_s=0.5,
    )
    sched = _Sent(settings)
    sched.tick()  # the deadline applies once the store has answered for a heartbeat timeout
    time.sleep(0.6)
    with session_scope(sqlite_url) as s:
        make_worker(s, "w1")
        job = make_job(s, name="a")
    assert [q for _, q in (sched.schedule_pass() and sched.sent)] == ["q.w1"]
    with session_scope(sqlite_url) as s:
        make_worker(s, "w2")
        s.execute(update(Assignment).values(created_at=utcnow() - timedelta(seconds=6)))
    sched.reconcile()
    with session_scope(sqlite_url) as s:
        j = s.get(Job, job.id)
        assert j is not None and j.state == "queued" and j.attempt == 2
        assert "did not claim" in (j.pending_reason or "")
        w1 = s.get(Worker, "w1")
        assert w1 is not None and w1.state == "lost"
        att = s.query(Attempt).filter_by(job_id=job.id, number=1).one()
        assert att.state == "handed_back"  # not counted against max_restarts
    sched.sent.clear()
    out = sched.schedule_pass()
    assert [(d.job_id, d.worker_id) for d in out] == [(job.id, "w2")]
