"""Artifacts on the worker: an `artifact` event is recorded with the sha256 and size the
worker measured by descriptor, never the event's word; a link, a forged path, a file that
no longer holds what was announced, or a name past the job's budget is not recorded; a name
saved again replaces its row; on an object store the file goes up before its row, and the
object of a replaced artifact is removed (no processes)."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session
from support.worker_factories import make_job, make_worker

from torchyard.contracts.eventmodel import EventLimits
from torchyard.scheduler.cycle import schedule
from torchyard.storage import beneath
from torchyard.storage.memory import MemoryStorage
from torchyard.store.models import Artifact, Attempt
from torchyard.worker.events import EventRecorder
from torchyard.worker.publish import CheckpointUploads, UploadPending


def _recorder(s: Session, **kw: object) -> EventRecorder:
    make_worker(s, "w1")
    job = make_job(s)
    schedule(s, heartbeat_timeout_s=10)
    s.commit()
    attempt = s.scalars(select(Attempt).where(Attempt.job_id == job.id)).one()
    return EventRecorder(job.id, attempt.id, attempt.number, **kw)  # type: ignore[arg-type]


def _save(run: Path, name: str, data: bytes, sha: str | None = None) -> dict[str, object]:
    (run / "artifacts").mkdir(parents=True, exist_ok=True)
    (run / "artifacts" / name).write_bytes(data)
    return {"type": "artifact", "time": 1.0, "step": 1, "name": name,
            "path": f"artifacts/{name}", "bytes": len(data),
            "sha256": sha or hashlib.sha256(data).hexdigest()}  # fmt: skip


def _rows(s: Session, job_id: str) -> dict[str, tuple[str, int]]:
    s.expire_all()
    rows = s.scalars(select(Artifact).where(Artifact.job_id == job_id))
    return {r.name: (r.sha256, r.bytes) for r in rows}


def test_artifacts_are_recorded_as_measured_and_a_name_saved_again_replaces_its_row(
    session: Session, tmp_path: Path
) -> None:
    s, run = session, tmp_path / "run"
    rec = _recorder(s, measure=lambda rel: beneath.hash_file(run, rel),
                    limits=EventLimits(artifacts=4))  # fmt: skip
    secret = tmp_path / "secret"
    secret.write_bytes(b"root's own file")
    rec.add(_save(run, "plot.png", b"png-1"))
    rec.add(_save(run, "plot.png", b"png-2"))  # the same batch: the last save wins
    lie = _save(run, "cfg.json", b"{}")
    rec.add({**lie, "bytes": 10**12})  # a size it made up: measured instead
    rec.add(_save(run, "lie.txt", b"abc", sha="0" * 64))  # bytes that do not hash so
    os.symlink(secret, run / "artifacts" / "link.txt")
    rec.add({**_save(run, "x", b""), "name": "link.txt", "path": "artifacts/link.txt"})
    rec.add({**_save(run, "y", b"y"), "path": "checkpoints/y"})  # a path not its name's
    rec.add(_save(run, "four.txt", b"4"))  # plot, cfg, lie, link counted: past 4
    rec.commit(lambda write: (write(s), s.commit()))
    rows = _rows(s, rec.job_id)
    assert rows == {
        "plot.png": (hashlib.sha256(b"png-2").hexdigest(), 5),
        "cfg.json": (hashlib.sha256(b"{}").hexdigest(), 2),
    }
    notes = " ".join(rec.set_aside.notes)
    assert "link.txt: its file cannot be read" in notes
    assert "artifact path 'checkpoints/y'" in notes and "at most 4" in notes
    assert secret.read_bytes() == b"root's own file"
    rec.add(_save(run, "plot.png", b"png-3"))  # a later batch: the row is replaced
    rec.commit(lambda write: (write(s), s.commit()))
    assert _rows(s, rec.job_id)["plot.png"] == (hashlib.sha256(b"png-3").hexdigest(), 5)
    assert len(_rows(s, rec.job_id)) == 2


def test_on_an_object_store_an_artifact_goes_up_first_and_a_replaced_one_goes(
    session: Session, tmp_path: Path
) -> None:
    s = session
    store, cache = MemoryStorage(tmp_path / "scratch"), tmp_path / "cache"
    rec = _recorder(s)
    rec.uploads = CheckpointUploads(store, cache, rec.job_id)
    run = cache / "jobs" / rec.job_id

    def commit(ev: dict[str, object]) -> None:
        rec.add(ev)
        deadline = time.monotonic() + 10
        while True:
            try:
                return rec.commit(lambda write: (write(s), s.commit()))
            except UploadPending:
                assert time.monotonic() < deadline, "the upload never became durable"
                time.sleep(0.01)

    def stored() -> list[str]:
        return sorted(o.key for o in store.list(f"jobs/{rec.job_id}/artifacts/"))

    commit(_save(run, "cm.png", b"one"))
    first = hashlib.sha256(b"one").hexdigest()
    assert _rows(s, rec.job_id) == {"cm.png": (first, 3)}
    assert stored() == [store.checkpoint_key(rec.job_id, "artifacts/cm.png", first)]
    commit(_save(run, "cm.png", b"two!"))
    second = hashlib.sha256(b"two!").hexdigest()
    assert _rows(s, rec.job_id) == {"cm.png": (second, 4)}
    rec.uploads.close()  # the replaced object's delete ran in the upload thread
    assert stored() == [store.checkpoint_key(rec.job_id, "artifacts/cm.png", second)]
