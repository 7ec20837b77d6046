"""How a sweep is shown: `describe_sweep` (its fields, then its trials best first), the
summary line a finished --follow prints, and the short trial-count and best-value cells of
`sweep list`. Shared by client/cmd_sweeps.py and the sweep follower in client/follow.py."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Group, RenderableType

from torchyard.client import render


def describe_sweep(sweep: dict) -> RenderableType:
    """The sweep's fields, then its trials sorted by value, best first (unscored last)."""
    obj = sweep.get("objective") or {}
    rows = [
        ("id", str(sweep.get("id"))),
        ("name", str(sweep.get("name"))),
        ("state", str(sweep.get("state"))),
        ("objective", f"{obj.get('mode')} {obj.get('metric')}"),
        (
            "search",
            f"{sweep.get('sampler')} sampler, pruner {sweep.get('pruner')}, "
            f"{sweep.get('parallel')} at once",
        ),
        ("trials", trials_done(sweep)),
        ("best", best_short(sweep)),
    ]
    if sweep.get("error"):
        rows.append(("error", str(sweep["error"])))
    trials = sweep.get("trials") or []
    if not trials:
        return render.fields(rows)
    names = sorted({k for t in trials for k in t.get("params") or {}})
    sign = -1.0 if obj.get("mode") == "max" else 1.0
    ordered = sorted(trials, key=lambda t: (t.get("value") is None, sign * (t.get("value") or 0)))
    table_rows = [
        (
            t.get("number"),
            (t.get("job_id") or "-")[:12],
            _trial_state(t),
            t.get("value"),
            t.get("step"),
            *(_param(t["params"].get(n)) for n in names),
        )
        for t in ordered
    ]
    headers = ["#", "JOB", "STATE", obj.get("metric") or "VALUE", "STEP", *names]
    return Group(render.fields(rows), "", render.table(headers, table_rows))


def sweep_summary_line(sweep: dict) -> str:
    text = f"sweep {sweep.get('id')} {sweep.get('state')} — {trials_done(sweep)}"
    best = sweep.get("best")
    if best:
        params = ", ".join(f"{k}={_param(v)}" for k, v in (best.get("params") or {}).items())
        metric = (sweep.get("objective") or {}).get("metric")
        text += (
            f"\nbest {metric} {render.fmt_value(best.get('value'))}: trial "
            f"{best.get('number')}, job {best.get('job_id')} ({params})"
        )
    return text


def _trial_state(t: dict) -> str:
    status = t.get("status")
    if status == "paused":  # pruner halving: waiting at a rung, its worker freed
        return f"paused at eval {t.get('paused_at')}"
    return str(t.get("state")) if status in (None, "running") else str(status)


def trials_done(sweep: dict) -> str:
    counts = sweep.get("counts") or {}
    done = sum(v for k, v in counts.items() if k not in ("running", "paused"))
    parts = [
        f"{counts[k]} {k}"
        for k in ("running", "paused", "complete", "pruned", "failed", "cancelled")
        if counts.get(k)
    ]
    return f"{done}/{sweep.get('max_trials')} done" + (f" ({', '.join(parts)})" if parts else "")


def best_short(sweep: dict) -> str:
    best = sweep.get("best")
    if not best:
        return "-"
    return f"{render.fmt_value(best.get('value'))} (trial {best.get('number')})"


def _param(v: Any) -> str:
    if isinstance(v, float):
        return render.fmt_value(v)
    return json.dumps(v) if isinstance(v, list | dict) else str(v)
