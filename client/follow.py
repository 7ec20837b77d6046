"""--follow: the job follower (`follow_job`, fed by the job's event stream, with the live
progress line and the summary line it ends on) and the sweep follower (`follow_sweep`, a live
table of the trials). Both ride out the API going away for a while (an `up` restart)."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, TextIO

from rich.console import RenderableType

from torchyard.client import render
from torchyard.client.cli_common import (
    EXIT_FAIL,
    EXIT_INTERRUPTED,
    EXIT_OK,
    RECONNECT_FOR_S,
    duration,
    note,
    num,
)
from torchyard.client.errors import ConnectError, TorchyardError, Unavailable
from torchyard.client.sdk import TERMINAL_STATES, Client
from torchyard.client.sweep_view import describe_sweep, sweep_summary_line
from torchyard.client.sysview import is_system

# -- following a job ----------------------------------------------------------------------------


def follow_job(
    client: Client, job_id: str, *, interval_s: float = 0.5, stream: TextIO | None = None
) -> int:
    """Draw the job's progress and latest metrics from its event stream until it ends.
    Survives the API going away for a while (an `up` restart): the stream resumes where it
    broke. Exit 0 if it succeeded, 1 if it failed or was cancelled."""
    status = render.Status(stream or sys.stderr)
    try:
        return _Follower(client, job_id, status, interval_s).run()
    except KeyboardInterrupt:
        status.done()
        note(f"stopped following; the job goes on (torchyard status {job_id})")
        return EXIT_INTERRUPTED


class _Follower:
    """--follow, fed by GET /v1/jobs/{id}/events: state lines as the job moves, a live
    progress line from the metric events. The job itself (progress totals, ETA, pending
    reason) is read on each state change and at most once per `refresh_s` while metrics
    flow, never polled on a timer; a queued job's new pending reasons come as `status`
    events."""

    def __init__(self, client: Client, job_id: str, status: render.Status, refresh_s: float):
        self.client, self.job_id, self.status, self.refresh_s = client, job_id, status, refresh_s
        self.job: dict = {}
        self.state: str | None = None
        self.latest: dict[str, tuple[int, float | None]] = {}
        self.step: int | None = None
        self.epoch: Any = None
        self.said: tuple[Any, ...] = ()
        self.refreshed_at = -math.inf

    def run(self) -> int:
        self.first_read()
        events = self.client.stream_events(
            self.job_id, reconnect_for_s=RECONNECT_FOR_S, on_retry=self.lost
        )
        for ev in events:
            if ev.event == "state":
                self.on_state(ev.data)
            elif ev.event == "metric":
                self.on_metric(ev.data)
            elif ev.event == "status":
                self.on_status(ev.data)
            elif ev.event == "end":
                self.state = ev.data.get("state") or self.state
        self.refresh(strict=False)
        self.status.done(progress_line(self.shown(), self.latest) if self.latest else None)
        self.status.message(summary_line(self.shown(), self.latest))
        return EXIT_OK if self.state == "succeeded" else EXIT_FAIL

    def first_read(self) -> None:
        """A wrong URL, token or id fails at once; an API that answers 503 (starting, or
        its database away for a moment) is waited for as long as a broken stream would be."""
        lost_since = time.monotonic()
        while True:
            try:
                self.refresh()
                return
            except Unavailable as e:
                if time.monotonic() - lost_since > RECONNECT_FOR_S:
                    raise
                self.lost(e)
                delay = self.client.reconnect_delay_s
                time.sleep(self.client._server_retry_s if delay is None else delay)

    def refresh(self, *, strict: bool = True) -> None:
        """Read the job. Only the first read must succeed (`first_read`); later, an API that is away keeps the last copy while the stream reconnects."""
        try:
            self.job = self.client.job(self.job_id)
        except (ConnectError, Unavailable):
            if strict:
                raise
        self.refreshed_at = time.monotonic()

    def on_state(self, data: dict) -> None:
        self.state = data.get("state")
        self.refresh(strict=False)
        shown = {**self.job, "state": self.state}
        shown["attempt"] = data.get("attempt") or self.job.get("attempt")
        if self.job.get("state") != self.state:  # an old event, replayed: no current reason
            shown["pending_reason"] = None
        now_said = (self.state, shown["attempt"])
        if now_said != self.said:
            self.status.message(_state_line(shown))
            self.said = now_said
        self.draw()

    def on_status(self, data: dict) -> None:
        """A queued job's pending reason changed (the scheduler's view of why it waits)."""
        reason = data.get("pending_reason")
        if self.state != "queued" or not reason or reason == self.job.get("pending_reason"):
            return
        self.job["pending_reason"] = reason
        self.status.message(_state_line({**self.job, "state": self.state}))

    def on_metric(self, data: dict) -> None:
        name, step, value = data.get("name"), int(data.get("step", 0)), data.get("value")
        if is_system(name or ""):
            return  # the worker's samples: their step is a Unix second, not training's
        if name and (name not in self.latest or step >= self.latest[name][0]):
            self.latest[name] = (step, value)
        if self.step is None or step >= self.step:
            self.step, self.epoch = step, data.get("epoch", self.epoch)
        if time.monotonic() - self.refreshed_at >= self.refresh_s:
            self.refresh(strict=False)
        self.draw()

    def lost(self, e: TorchyardError) -> None:
        self.status.update(f"API unreachable, retrying… ({str(e).split(';')[0]})")

    def shown(self) -> dict:
        """The job as last read, its progress moved on by the metric events since."""
        progress = dict(self.job.get("progress") or {})
        if self.step is not None and self.step >= (progress.get("step") or 0):
            progress["step"] = self.step
            if self.epoch is not None:
                progress["epoch"] = self.epoch
        return {**self.job, "state": self.state or self.job.get("state"), "progress": progress}

    def draw(self) -> None:
        # Not before the first step is known: a plain-text log's first line would be a bar
        # with neither epoch nor step, and it is the one line shown for several seconds.
        shown = self.shown()
        if self.state in ("running", "cancelling") and shown["progress"].get("step") is not None:
            self.status.update(progress_line(shown, self.latest))


def _state_line(job: dict) -> str:
    state, attempt = job.get("state"), job.get("attempt")
    text = f"{job.get('id', '')[:12]} {state}"
    if attempt and attempt > 1:
        text += f" (attempt {attempt})"
    if state == "queued" and job.get("pending_reason"):
        text += f": {job['pending_reason']}"
    return text


SHOWN_METRICS = ("train/loss", "val/loss", "val/accuracy")


def progress_line(job: dict, latest: dict[str, tuple[int, float | None]]) -> RenderableType:
    p = job.get("progress") or {}
    spec = job.get("spec") or {}
    step, total = p.get("step"), p.get("total_steps")
    parts: list[RenderableType] = []
    if p.get("epoch") is not None:
        epochs = spec.get("epochs")
        parts.append(f"epoch {num(p['epoch'])}" + (f"/{epochs}" if epochs else ""))
    parts.append(render.bar(step, total))
    if step is not None:
        parts.append(f"{step}/{total if total else '?'}")
    if p.get("samples_per_s"):
        parts.append(f"{p['samples_per_s']:,.0f} samples/s")
    done = step is not None and bool(total) and step >= total
    if job.get("state") not in TERMINAL_STATES and not done:
        parts.append(f"ETA {render.human_duration(p.get('eta_s'))}")
    for name in SHOWN_METRICS:
        if name in latest:
            parts.append(f"{name} {render.fmt_value(latest[name][1])}")
    return render.line(parts)


def summary_line(job: dict, latest: dict[str, tuple[int, float | None]]) -> str:
    state = job.get("state")
    took = duration(job.get("created_at"), job.get("finished_at"))
    text = f"job {job.get('id')} {state}" + (f" in {took}" if took else "")
    shown = [f"{n} {render.fmt_value(latest[n][1])}" for n in SHOWN_METRICS if n in latest]
    if shown:
        text += " — " + ", ".join(shown)
    if state == "failed" and job.get("error"):
        text += f"\nerror: {job['error']}"
    if state == "succeeded":
        text += (
            f"\n  torchyard metrics {job.get('id')} --plot\n  torchyard download {job.get('id')}"
        )
    return text


# -- following a sweep --------------------------------------------------------------------------


def follow_sweep(
    client: Client, sweep_id: str, *, interval_s: float = 2.0, stream: TextIO | None = None
) -> int:
    """A live table of the sweep's trials, best first, redrawn until the sweep has ended and
    its trials have stopped. Keeps retrying while the API is away. Exit 0 if it succeeded,
    1 if it failed or was cancelled."""
    status = render.Status(stream or sys.stderr)
    sweep, lost_since = client.get_sweep(sweep_id), None
    try:
        while sweep.get("state") == "running" or (sweep.get("counts") or {}).get("running"):
            status.update(describe_sweep(sweep))
            time.sleep(interval_s)
            try:
                sweep, lost_since = client.get_sweep(sweep_id), None
            except (ConnectError, Unavailable) as e:
                lost_since = lost_since or time.monotonic()
                if time.monotonic() - lost_since > RECONNECT_FOR_S:
                    raise
                status.update(f"API unreachable, retrying… ({str(e).split(';')[0]})")
    except KeyboardInterrupt:
        status.done()
        note(f"stopped following; the sweep goes on (torchyard sweep status {sweep_id})")
        return EXIT_INTERRUPTED
    status.done(describe_sweep(sweep))
    status.message(sweep_summary_line(sweep))
    return EXIT_OK if sweep.get("state") == "succeeded" else EXIT_FAIL
