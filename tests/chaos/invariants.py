"""What must hold after any mix of faults, read from the trainers' own files (each host's
cache), the object store and the database.

No directory is shared: a job's events are the lines its rank-0 trainers wrote into
`events.jsonl` on whichever hosts they ran (a host that takes a job after another starts
its file as a sparse one at the recorded offset: NULs, no lines), its checkpoints and final
weights are objects in the store."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load
from sqlalchemy import create_engine, select
from torch import Tensor, equal

from torchyard.contracts.eventmodel import SYS_PREFIX
from torchyard.storage import Storage
from torchyard.store.models import Checkpoint, Metric
from torchyard.store.paths import EVENTS_FILE, job_dir


def events_of(caches: Sequence[Path], job_id: str) -> list[dict[str, Any]]:
    """Every event line of the job in any host's events file (torn lines skipped)."""
    out = []
    for cache in caches:
        p = job_dir(cache, job_id) / EVENTS_FILE
        for line in p.read_bytes().split(b"\n") if p.is_file() else []:
            try:
                ev = json.loads(line.lstrip(b"\0"))  # a sparse start has no line ends
            except ValueError:
                continue  # a line torn by a kill or a full disk
            if isinstance(ev, dict):
                out.append(ev)
    return out


def overlaps(events: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Pairs of attempts of one job whose trainers ran at the same time, from the trainers'
    own clocks: attempt n runs from its first to its last event line."""
    spans: dict[int, list[float]] = {}
    for ev in events:
        n, t = ev.get("attempt"), ev.get("time")
        if isinstance(n, int) and isinstance(t, int | float):
            lo_hi = spans.setdefault(n, [t, t])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], t), max(lo_hi[1], t)
    out: list[tuple[int, int]] = []
    latest: tuple[int, float] | None = None  # the attempt that ran longest so far, its end
    for n, (lo, hi) in sorted(spans.items(), key=lambda kv: kv[1][0]):
        if latest is not None and latest[1] > lo:
            out.append((latest[0], n))
        if latest is None or hi > latest[1]:
            latest = (n, hi)
    return out


@dataclass(frozen=True)
class CheckpointRow:
    path: str
    bytes: int
    sha256: str
    kind: str = "resume"
    deleted: bool = False


def object_problem(store: Storage, job_id: str, row: CheckpointRow) -> str | None:
    """Why the row's object is not durable as recorded (missing, another size or sha256,
    by its metadata or its bytes), or None."""
    try:
        key = store.checkpoint_key(job_id, row.path, row.sha256)
        info = store.stat(key)
        h, n = hashlib.sha256(), 0
        with store.open_read(key) as f:
            while block := f.read(1 << 20):
                h.update(block)
                n += len(block)
    except FileNotFoundError:
        return f"{row.kind} {row.path}: listed but not in the object store"
    if info.size != row.bytes or n != row.bytes:
        return (
            f"{row.kind} {row.path}: {n} bytes stored ({info.size} by stat), {row.bytes} recorded"
        )
    if (info.sha256 is not None and info.sha256 != row.sha256) or h.hexdigest() != row.sha256:
        return (
            f"{row.kind} {row.path}: stored sha256 {h.hexdigest()[:12]}, recorded {row.sha256[:12]}"
        )
    return None


def checkpoint_problems(store: Storage, job_id: str, rows: Iterable[CheckpointRow]) -> list[str]:
    """Every checkpoint the store lists (not deleted) is an object with its recorded size
    and sha256: nothing was reported before it was durable."""
    found = (object_problem(store, job_id, r) for r in rows if not r.deleted)
    return [f"{job_id}: {p}" for p in found if p is not None]


def weights_problem(store: Storage, job_id: str, rows: Iterable[CheckpointRow]) -> str | None:
    """A succeeded job's final weights: recorded, and stored with the recorded sha256."""
    weights = [r for r in rows if r.kind == "weights" and not r.deleted]
    if not weights:
        return f"{job_id}: succeeded with no weights on record"
    problem = object_problem(store, job_id, weights[-1])
    return None if problem is None else f"{job_id}: succeeded but {problem}"


def stored_weights(store: Storage, job_id: str, rows: Iterable[CheckpointRow]) -> dict[str, Tensor]:
    row = next(r for r in rows if r.kind == "weights" and not r.deleted)  # weights_problem: there
    with store.open_read(store.checkpoint_key(job_id, row.path, row.sha256)) as f:
        return load(f.read())


def notification_problems(
    jobs: dict[str, dict[str, Any]], received: Iterable[tuple[str, str, str]]
) -> list[str]:
    """No notification lost: every job that ended has a webhook POST of its terminal event
    received (`received`: (X-Torchyard-Delivery, X-Torchyard-Event, the body's job id) per
    POST; duplicates allowed, at least once) and one delivery id per (job, event)."""
    ids: dict[tuple[str, str], set[str]] = {}
    for delivery, event, job_id in received:
        ids.setdefault((job_id, event), set()).add(delivery)
    problems = []
    for job_id, j in jobs.items():
        if j["state"] not in ("succeeded", "failed", "cancelled"):
            continue
        got = ids.get((job_id, f"job.{j['state']}"), set())
        if not got:
            problems.append(f"{job_id}: no job.{j['state']} notification received")
        elif len(got) > 1:
            problems.append(f"{job_id}: job.{j['state']} notified as {len(got)} deliveries")
    return problems


@dataclass
class Report:
    jobs: int = 0
    not_succeeded: list[str] = field(default_factory=list)
    lost_metrics: int = 0
    extra_metrics: int = 0
    bad_checkpoints: int = 0
    bad_weights: int = 0
    weight_mismatches: int = 0
    overlaps: int = 0
    attempts: int = 0
    checkpoints: int = 0
    problems: list[str] = field(default_factory=list)

    def line(self, **more: Any) -> str:
        figures = {
            "jobs": self.jobs,
            "not_succeeded": len(self.not_succeeded),
            "attempts": self.attempts,
            "checkpoints": self.checkpoints,
            "lost_metrics": self.lost_metrics,
            "extra_metrics": self.extra_metrics,
            "bad_checkpoints": self.bad_checkpoints,
            "bad_weights": self.bad_weights,
            "weight_mismatches": self.weight_mismatches,
            "overlaps": self.overlaps,
            **more,
        }
        return "chaos: " + " ".join(f"{k}={v}" for k, v in figures.items())


def _metrics(r: Report, c: Any, job_id: str, evs: list[dict[str, Any]]) -> None:
    """Every metric a trainer wrote is stored, and nothing else (the workers' own `sys/`
    series are theirs: a trainer's `sys/` event is set aside, tests/worker)."""
    wrote = {(e["name"], e["step"]) for e in evs if e.get("type") == "metric"}
    stored = set(c.execute(select(Metric.name, Metric.step).where(Metric.job_id == job_id)).all())
    stored = {(n, int(s)) for n, s in stored if not n.startswith(SYS_PREFIX)}
    lost, extra = wrote - stored, stored - wrote
    r.lost_metrics += len(lost)
    r.extra_metrics += len(extra)
    if lost or extra:
        r.problems.append(f"{job_id}: metrics lost {sorted(lost)[:5]} extra {sorted(extra)[:5]}")


def check(
    db_url: str,
    store: Storage,
    caches: Sequence[Path],
    jobs: dict[str, dict[str, Any]],
    references: dict[str, Path],
) -> Report:
    """`jobs`: job id -> its final JSON from the API (with `_ref`: its reference's key);
    `caches`: every worker host's storage root."""
    r = Report(jobs=len(jobs))
    engine = create_engine(db_url)
    try:
        with engine.connect() as c:
            for job_id, j in jobs.items():
                r.attempts += j["attempt"]
                if j["state"] != "succeeded":
                    r.not_succeeded.append(job_id)
                    r.problems.append(f"{job_id}: {j['state']} ({j.get('error')})")
                evs = events_of(caches, job_id)
                _metrics(r, c, job_id, evs)
                cols = (Checkpoint.path, Checkpoint.bytes, Checkpoint.sha256, Checkpoint.kind,
                        Checkpoint.deleted)  # fmt: skip
                rows = [
                    CheckpointRow(*row)
                    for row in c.execute(
                        select(*cols).where(Checkpoint.job_id == job_id).order_by(Checkpoint.id)
                    )
                ]
                r.checkpoints += sum(not row.deleted for row in rows)
                bad = checkpoint_problems(store, job_id, rows)
                r.bad_checkpoints += len(bad)
                r.problems.extend(bad)
                pairs = overlaps(evs)
                r.overlaps += len(pairs)
                if pairs:
                    r.problems.append(f"{job_id}: attempts ran at once: {pairs}")
                if j["state"] != "succeeded":
                    continue
                if (problem := weights_problem(store, job_id, rows)) is not None:
                    r.bad_weights += 1
                    r.problems.append(problem)
                    continue
                got = stored_weights(store, job_id, rows)
                want = load(Path(references[j["_ref"]]).read_bytes())
                if got.keys() != want.keys() or not all(equal(got[k], want[k]) for k in want):
                    r.weight_mismatches += 1
                    r.problems.append(f"{job_id}: final weights differ from the reference")
    finally:
        engine.dispose()
    return r
