"""Terminal output: sizes and durations in words, tables and live status lines (rich), and the
loss plot (plotext). On a terminal rich draws in colour and redraws in place; piped or under
NO_COLOR it writes plain text (no ANSI codes), the live line as a line every few seconds."""

from __future__ import annotations

import io
import math
import time
from collections.abc import Sequence
from typing import TextIO

import plotext
from rich.cells import cell_len
from rich.console import Console, RenderableType
from rich.live import Live
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskProgressColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.progress_bar import ProgressBar
from rich.table import Table

# Piped output is read by programs and people with wide windows: never wrap or crop it.
PIPE_WIDTH = 1000
BAR_WIDTH = 24
# One marker per series: the plot must read without colour too.
_MARKERS = "*o+x#@"


def console(stream: TextIO) -> Console:
    """A rich console on `stream`: colour and redraws only on a terminal; NO_COLOR obeyed
    (by rich). Text is never read as markup, so a `[` in a job name prints as it is."""
    out = Console(file=stream, markup=False, highlight=False, emoji=False)
    if not out.is_terminal:
        out.width = PIPE_WIDTH
    return out


def colour(out: Console) -> bool:
    """Whether to colour what we draw ourselves (the plot): a terminal, and no NO_COLOR."""
    return out.is_terminal and out.color_system is not None and not out.no_color


def to_text(renderable: RenderableType, width: int = PIPE_WIDTH) -> str:
    """What `renderable` prints on a plain (piped) stream, as a string, without the
    trailing blanks rich pads cells with."""
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, markup=False, highlight=False).print(
        renderable
    )
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines())


def show(renderable: RenderableType, stream: TextIO) -> None:
    """Print a table or a group: styled on a terminal, plain text elsewhere."""
    out = console(stream)
    if out.is_terminal:
        out.print(renderable)
    else:
        stream.write(to_text(renderable) + "\n")


def human_bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "--:--"
    s = round(seconds)
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def human_age(seconds: float | None) -> str:
    """`42s`, `7m`, `3h`, `2d`: how long ago."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = max(0, int(seconds))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s // size}{unit}"
    return f"{s}s"


def fmt_value(v: float | None) -> str:
    """A metric value in 4 significant digits: 0.001234, not 0.0012 (nor 0.0000 for a
    tiny loss); scientific below 1e-3 and from 1e5."""
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        if v == 0 or abs(v) >= 1:
            return f"{v:.4g}"
        return f"{v:.{3 - math.floor(math.log10(abs(v)))}f}"
    return f"{v:.3e}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> Table:
    """Borderless columns two spaces apart, bold headers; numeric columns right-aligned."""
    t = Table(box=None, pad_edge=False, show_edge=False, header_style="bold", padding=(0, 1))
    for i, h in enumerate(headers):
        values = [r[i] for r in rows if r[i] is not None]
        numeric = bool(values) and all(_is_num(v) for v in values)
        t.add_column(h, justify="right" if numeric else "left", no_wrap=True)
    for r in rows:
        t.add_row(*(_cell(c) for c in r))
    return t


def fields(rows: Sequence[tuple[str, str]]) -> Table:
    """`key  value` lines, the keys aligned."""
    t = Table.grid(padding=(0, 2))
    t.add_column(style="bold", no_wrap=True)
    t.add_column()
    for k, v in rows:
        t.add_row(k, v)
    return t


def line(parts: Sequence[RenderableType]) -> Table:
    """Text and bars on one line, two spaces apart. On a narrow terminal the bars shrink;
    the text never is cut."""
    t = Table.grid(padding=(0, 2))
    for part in parts:
        if isinstance(part, str):
            t.add_column(no_wrap=True, min_width=cell_len(part))
        else:
            t.add_column(min_width=6, max_width=BAR_WIDTH)
    t.add_row(*parts)
    return t


def bar(completed: float | None, total: float | None) -> RenderableType:
    """A progress bar; blank while the total is unknown (a pulse would look like motion)."""
    if completed is None or not total:
        return " " * BAR_WIDTH
    return ProgressBar(total=total, completed=min(completed, total))


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return fmt_value(v)
    return str(v)


class Status:
    """One live status line on `stream`, with messages printed above it. On a terminal a
    rich Live redraws it in place; elsewhere (logs, CI, pipes) it is printed as a plain line
    at most every `plain_every_s`, and once more at the end if it changed."""

    def __init__(self, stream: TextIO, *, plain_every_s: float = 5.0) -> None:
        self.console = console(stream)
        self.plain_every_s = plain_every_s
        self._live: Live | None = None
        self._last_plain: str | None = None
        self._last_plain_at = -math.inf

    def update(self, line: RenderableType) -> None:
        if self.console.is_terminal:
            if self._live is None:
                self._live = Live(line, console=self.console, refresh_per_second=8, transient=False)
                self._live.start()
            else:
                self._live.update(line)
            return
        if time.monotonic() - self._last_plain_at >= self.plain_every_s:
            self._print_plain(line)

    def message(self, text: str) -> None:
        """A line of its own, above the status line."""
        self.console.print(text, soft_wrap=True)

    def done(self, line: RenderableType | None = None) -> None:
        """Draw `line` one last time and leave it on screen."""
        if self._live is not None:
            if line is not None:
                self._live.update(line)
            self._live.stop()
            self._live = None
        elif line is not None and self.console.is_terminal:
            self.console.print(line)
        elif line is not None:
            self._print_plain(line)

    def _print_plain(self, line: RenderableType) -> None:
        text = to_text(line, self.console.width)
        if text != self._last_plain:
            self.console.print(text, soft_wrap=True)
            self._last_plain = text
        self._last_plain_at = time.monotonic()


class Transfer:
    """A download's progress: bar, percent, bytes, speed and time left (rich.progress), drawn
    through a Status on a terminal. Elsewhere (logs, CI, pipes) repeated bar lines would only
    be noise: it prints nothing while the bytes arrive and one summary line at the end
    (`summary`). Call it as `on_progress(done, total)`, then `done(size)`."""

    def __init__(self, stream: TextIO, *, plain_every_s: float = 2.0) -> None:
        self.status = Status(stream, plain_every_s=plain_every_s)
        self.live = self.status.console.is_terminal
        self.progress = Progress(
            BarColumn(bar_width=30),
            TaskProgressColumn(),
            DownloadColumn(binary_units=True),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.status.console,
            auto_refresh=False,  # drawn by the Status, never started on its own
        )
        self.task = self.progress.add_task("download", total=None)
        self._started: float | None = None
        self._kept = 0  # bytes already on disk at the first call (a resumed .part)

    def __call__(self, done: int, total: int | None) -> None:
        if self._started is None:
            self._started, self._kept = time.monotonic(), done
        if not self.live:
            return
        self.progress.update(self.task, completed=done, total=total)
        self.status.update(self.progress.get_renderable())

    def done(self, size: int) -> None:
        if not self.live:
            elapsed = time.monotonic() - self._started if self._started is not None else 0.0
            self.status.message(summary(size, self._kept, elapsed))
            return
        self.progress.update(self.task, completed=size, total=size)
        self.status.done(self.progress.get_renderable())


def summary(size: int, kept: int, elapsed: float) -> str:
    """A finished download in one line: `downloaded 16.0 MiB in 0:03 (5.3 MiB/s)`, and the
    bytes a resumed download kept from before."""
    fetched = max(0, size - kept)
    text = f"downloaded {human_bytes(fetched)} in {human_duration(elapsed)}"
    if elapsed > 0 and fetched:
        text += f" ({human_bytes(fetched / elapsed)}/s)"
    if kept:
        text += f"; {human_bytes(kept)} kept from before, {human_bytes(size)} in all"
    return text


def plot(
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    width: int = 72,
    height: int = 18,
    color: bool = False,
    log_y: bool = False,
) -> str:
    """Line plot of several (steps, values) series as text (plotext): one marker per series
    (and one colour, when `color`), a `step` axis, and the legend on the last line."""
    pts = {n: _plottable(xs, ys, log_y) for n, (xs, ys) in series.items()}
    pts = {n: p for n, p in pts.items() if p[0]}
    if not pts:
        return "(no data to plot)"
    fig = plotext.figure  # module-global: clear what an earlier call left
    fig.clear.data()
    fig.clear.settings()
    fig.plot_size(width, height)
    fig.theme("simple" if color else "colorless")  # simple: no painted background
    for i, (name, (xs, ys)) in enumerate(pts.items()):
        sig = fig.signal(xs, ys, marker=_MARKERS[i % len(_MARKERS)])
        sig.label(name)
        sig.lines()
        fig.draw(sig)
    if log_y:
        fig.ruler(axis=1).scale("log")
    fig.legend(False)  # a box inside the canvas would hide the curves: listed below instead
    fig.label("step", axis=0)
    legend = "   ".join(f"{_MARKERS[i % len(_MARKERS)]} {n}" for i, n in enumerate(pts))
    legend += "   (log scale)" if log_y else ""
    return fig.build().string(colorless=not color).rstrip() + "\n" + legend


def _plottable(
    xs: Sequence[float], ys: Sequence[float], log_y: bool
) -> tuple[list[float], list[float]]:
    keep = [
        (float(x), float(y))
        for x, y in zip(xs, ys, strict=False)
        if y is not None and math.isfinite(y) and (y > 0 or not log_y)
    ]
    return [x for x, _ in keep], [y for _, y in keep]
