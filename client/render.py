"""Terminal output with no dependencies: sizes and durations, tables, progress bars that
redraw in place on a TTY and fall back to plain lines elsewhere, and a loss plot."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from typing import TextIO


def can_unicode(stream: TextIO) -> bool:
    enc = (getattr(stream, "encoding", None) or "ascii").lower().replace("-", "")
    return enc in ("utf8", "utf16", "utf32")


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
    if v is None:
        return "-"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.4g}" if abs(v) >= 1 else f"{v:.4f}"
    return f"{v:.3e}"


def bar(fraction: float | None, width: int, unicode: bool) -> str:
    full, empty = ("█", "░") if unicode else ("#", "-")
    if fraction is None:
        return empty * width
    n = max(0, min(width, round(fraction * width)))
    return full * n + empty * (width - n)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Left-aligned text columns, numbers right-aligned."""
    cells = [[_cell(c) for c in r] for r in rows]
    widths = [len(h) for h in headers]
    for r in cells:
        for i, c in enumerate(r):
            widths[i] = max(widths[i], len(c))
    numeric = [
        all(_is_num(r[i]) for r in rows if r[i] is not None) and any(r[i] is not None for r in rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        out = [
            v.rjust(widths[i]) if numeric[i] else v.ljust(widths[i]) for i, v in enumerate(values)
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), *(line(r) for r in cells)])


def _is_num(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return fmt_value(v)
    return str(v)


class Live:
    """One status line: redrawn in place on a TTY (throttled), printed as plain lines at most
    every `plain_every_s` elsewhere (logs, CI, pipes)."""

    def __init__(
        self, stream: TextIO | None = None, *, plain_every_s: float = 5.0, min_redraw_s: float = 0.1
    ) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.unicode = can_unicode(self.stream)
        self.plain_every_s = plain_every_s
        self.min_redraw_s = min_redraw_s
        self._last_draw = 0.0
        self._last_plain = ""
        self._width = 0

    def update(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            if not force and now - self._last_draw < self.min_redraw_s:
                return
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            if text == self._last_plain:
                return
            if not force and now - self._last_draw < self.plain_every_s:
                return
            self.stream.write(text + "\n")
            self._last_plain = text
        self._last_draw = now
        self.stream.flush()

    def message(self, text: str) -> None:
        """A line of its own above the status line."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self._width = 0
        self.stream.write(text + "\n")
        self.stream.flush()
        self._last_draw = 0.0

    def done(self, text: str | None = None) -> None:
        if text is not None:
            self.update(text, force=True)
        if self.tty and self._width:
            self.stream.write("\n")
            self._width = 0
        self.stream.flush()


def transfer_line(done: int, total: int | None, rate: float | None, unicode: bool) -> str:
    frac = done / total if total else None
    pct = f"{frac * 100:5.1f}%" if frac is not None else "     "
    eta = (total - done) / rate if total and rate else None
    speed = f"{human_bytes(rate)}/s" if rate else "-"
    return (
        f"{bar(frac, 30, unicode)} {pct}  {human_bytes(done)} / {human_bytes(total)}  "
        f"{speed}  ETA {human_duration(eta)}"
    )


def plot(
    series: dict[str, tuple[Sequence[float], Sequence[float]]],
    *,
    width: int = 72,
    height: int = 18,
    unicode: bool = True,
    log_y: bool = False,
) -> str:
    """A line plot of several (steps, values) series in text. Each column shows, per series,
    the range of values whose steps fall into it, so spikes stay visible."""
    markers = "●○◆◇▲△" if unicode else "*o+x#@"
    pts = {
        n: [(float(x), float(y)) for x, y in zip(xs, ys, strict=False) if _plottable(y, log_y)]
        for n, (xs, ys) in series.items()
    }
    pts = {n: p for n, p in pts.items() if p}
    if not pts:
        return "(no data to plot)"
    tf = (lambda v: math.log10(v)) if log_y else (lambda v: v)
    xs = [x for p in pts.values() for x, _ in p]
    ys = [tf(y) for p in pts.values() for _, y in p]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    if x1 == x0:
        x1 = x0 + 1
    grid = [[" "] * width for _ in range(height)]

    def col(x: float) -> int:
        return min(width - 1, int((x - x0) / (x1 - x0) * (width - 1) + 0.5))

    def row(y: float) -> int:
        return min(height - 1, int((y1 - tf(y)) / (y1 - y0) * (height - 1) + 0.5))

    for i, p in enumerate(pts.values()):
        mark = markers[i % len(markers)]
        by_col: dict[int, list[int]] = {}
        for x, y in p:
            by_col.setdefault(col(x), []).append(row(y))
        prev_col, prev_row = -10, 0
        for c in sorted(by_col):
            rows = by_col[c]
            lo, hi = min(rows), max(rows)
            # Join to the previous column with a vertical stroke, so a steep drop reads as a line.
            if c - prev_col <= 2:
                lo = min(lo, prev_row + 1)
                hi = max(hi, prev_row - 1)
            for r in range(lo, hi + 1):
                grid[r][c] = mark
            prev_col, prev_row = c, rows[-1]

    def ylabel(r: int) -> str:
        v = y1 - (y1 - y0) * r / (height - 1)
        return fmt_value(10**v if log_y else v)

    labels = {0: ylabel(0), height // 2: ylabel(height // 2), height - 1: ylabel(height - 1)}
    lw = max(len(s) for s in labels.values())
    vert, corner, horiz = ("│", "└", "─") if unicode else ("|", "+", "-")
    lines = [f"{labels.get(r, ''):>{lw}} {vert}{''.join(grid[r])}".rstrip() for r in range(height)]
    lines.append(" " * lw + " " + corner + horiz * width)
    left, right = f"step {int(x0)}", f"{int(x1)}"
    lines.append(" " * (lw + 2) + left + right.rjust(width - len(left)))
    legend = "   ".join(f"{markers[i % len(markers)]} {n}" for i, n in enumerate(pts))
    lines.append(" " * (lw + 2) + legend + ("   (log scale)" if log_y else ""))
    return "\n".join(lines)


def _plottable(y: float, log_y: bool) -> bool:
    return y is not None and math.isfinite(y) and (y > 0 or not log_y)
