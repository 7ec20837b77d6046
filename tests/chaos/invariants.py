"""What must hold after any mix of faults, read from the trainers' own files and the store."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors.torch import load_file
from sqlalchemy import create_engine, select
from torch import equal

from torchyard.store.models import Checkpoint, Metric
from torchyard.store.paths import EVENTS_FILE, job_dir


def events_of(storage: Path, job_id: str) -> list[dict[str, Any]]:
    out = []
    p = job_dir(storage, job_id) / EVENTS_FILE
    for line in p.read_text(errors="replace").splitlines() if p.exists() else []:
        try:
            ev = json.loads(line)
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


@dataclass
class Report:
    jobs: int = 0
    not_succeeded: list[str] = field(default_factory=list)
    lost_metrics: int = 0
    extra_metrics: int = 0
    bad_checkpoints: int = 0
    weight_mismatches: int = 0
    overlaps: int = 0
    attempts: int = 0
    problems: list[str] = field(default_factory=list)

    def line(self, **more: Any) -> str:
        figures = {
            "jobs": self.jobs,
            "not_succeeded": len(self.not_succeeded),
            "attempts": self.attempts,
            "lost_metrics": self.lost_metrics,
            "extra_metrics": self.extra_metrics,
            "bad_checkpoints": self.bad_checkpoints,
            "weight_mismatches": self.weight_mismatches,
            "overlaps": self.overlaps,
            **more,
        }
        return "chaos: " + " ".join(f"{k}={v}" for k, v in figures.items())


def check(
    db_url: str,
    storage: Path,
    jobs: dict[str, dict[str, Any]],
    references: dict[str, Path],
) -> Report:
    """`jobs`: job id -> its final JSON from the API (with `_ref`: its reference's key)."""
    r = Report(jobs=len(jobs))
    engine = create_engine(db_url)
    try:
        with engine.connect() as c:
            for job_id, j in jobs.items():
                r.attempts += j["attempt"]
                if j["state"] != "succeeded":
                    r.not_succeeded.append(job_id)
                    r.problems.append(f"{job_id}: {j['state']} ({j.get('error')})")
                evs = events_of(storage, job_id)
                wrote = {(e["name"], e["step"]) for e in evs if e.get("type") == "metric"}
                stored = set(
                    c.execute(select(Metric.name, Metric.step).where(Metric.job_id == job_id)).all()
                )
                stored = {(n, int(s)) for n, s in stored}
                lost, extra = wrote - stored, stored - wrote
                r.lost_metrics += len(lost)
                r.extra_metrics += len(extra)
                if lost or extra:
                    r.problems.append(
                        f"{job_id}: metrics lost {sorted(lost)[:5]} extra {sorted(extra)[:5]}"
                    )
                for path, sha, deleted in c.execute(
                    select(Checkpoint.path, Checkpoint.sha256, Checkpoint.deleted).where(
                        Checkpoint.job_id == job_id
                    )
                ):
                    if deleted:
                        continue
                    f = job_dir(storage, job_id) / path
                    if not f.is_file() or hashlib.sha256(f.read_bytes()).hexdigest() != sha:
                        r.bad_checkpoints += 1
                        r.problems.append(f"{job_id}: checkpoint {path} missing or not {sha[:12]}")
                pairs = overlaps(evs)
                r.overlaps += len(pairs)
                if pairs:
                    r.problems.append(f"{job_id}: attempts ran at once: {pairs}")
                if j["state"] == "succeeded":
                    got = load_file(str(job_dir(storage, job_id) / "model.safetensors"))
                    want = load_file(str(references[j["_ref"]]))
                    if got.keys() != want.keys() or not all(equal(got[k], want[k]) for k in want):
                        r.weight_mismatches += 1
                        r.problems.append(f"{job_id}: final weights differ from the reference")
    finally:
        engine.dispose()
    return r
