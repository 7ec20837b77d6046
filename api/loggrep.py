"""Searching a job's log on the server at a bounded cost (`GET /v1/jobs/{id}/logs?grep=`).

The pattern is a fixed string (as `grep -F`): no regular expression, so no pattern can make
an API worker backtrack for minutes. One request scans at most `scan_bytes` of the log from
`offset`, read through a `read(start, limit) -> (bytes, size)` callable (the storage seam's
`read_range`, so local disks and object stores alike) in chunks of `chunk_bytes`, carrying
the unfinished last line of a chunk into the next. Matching lines are found with `bytes.find`
over the whole chunk (C speed; `ignore_case` lowers the chunk's ASCII letters first, and for a
non-ASCII pattern the chunk is decoded and Unicode-lowered once, a match's line then found by
counting line breaks). The answer is bounded too: at most `limit_matches` matches, lines cut
at `max_line_bytes`, and no more than `MAX_ANSWER_BYTES` of line text; and so is its time
(`max_s`, checked between chunks: the scan then stops with `stopped_early`). `next_offset`
says where to go on. A line longer than a chunk is searched piece by piece (keeping the
pattern's length of overlap) and never held whole in memory.

Storage-free and store-free: the route hands it a reader."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

CHUNK_BYTES = 4 * 1024 * 1024  # one read of the log
MAX_LINE_BYTES = 4096  # a line (match or context) is cut at this length in an answer
MAX_ANSWER_BYTES = 4 * 1024 * 1024  # line text one answer carries at most
SEED_BYTES = 64 * 1024  # read before `offset` for the first match's `before` lines
AFTER_BYTES = 1024 * 1024  # read past the scan's end for the last matches' `after` lines

Reader = Callable[[int, int], tuple[bytes, int]]


@dataclass
class Line:
    offset: int  # byte offset of the line's start in the log
    raw: bytes  # the line, cut at max_line_bytes + 1 (one more: to know it was cut)


@dataclass
class Match:
    line: Line
    before: list[Line]
    after: list[Line] = field(default_factory=list)


@dataclass
class GrepResult:
    matches: list[Match]
    offset: int  # where the scan began
    next_offset: int  # where the next request goes on
    size: int  # the log's size when the scan began
    complete: bool  # the scan reached the end of the log
    scanned: int  # bytes searched
    stopped_early: bool = False  # the time bound, not the byte budget, ended the scan


def text(raw: bytes, max_bytes: int = MAX_LINE_BYTES) -> tuple[str, bool]:
    """A line as shown: at most `max_bytes` (never cut inside a UTF-8 character), no line
    ending; and whether it was cut."""
    cut = len(raw) > max_bytes
    if cut:
        raw = raw[:max_bytes]
        i = len(raw)
        while i > 0 and len(raw) - i < 3 and raw[i - 1] & 0xC0 == 0x80:
            i -= 1  # continuation bytes of a character the cut may have split
        if i > 0 and raw[i - 1] >= 0xC0:
            lead = raw[i - 1]
            need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4
            if i - 1 + need > len(raw):
                raw = raw[: i - 1]
    return raw.decode("utf-8", errors="replace").rstrip("\r"), cut


class Matcher:
    """Where a fixed string occurs, by lines."""

    def __init__(self, pattern: str, ignore_case: bool):
        self.ignore_case = ignore_case
        # ASCII-only patterns are found in the bytes (lowered bytes for ignore_case: lowering
        # touches ASCII letters only, so offsets stay those of the log).
        self.by_bytes = pattern.isascii() or not ignore_case
        self.pattern = pattern.lower() if ignore_case else pattern
        self.needle = self.pattern.encode("utf-8")
        # A long line is searched in pieces: this much of the previous piece is kept.
        self.overlap = max(len(self.needle) * 2, 16)

    def hay(self, buf: bytes) -> bytes:
        return buf.lower() if self.ignore_case and self.by_bytes else buf

    def contains(self, raw: bytes) -> bool:
        if self.by_bytes:
            return self.needle in self.hay(raw)
        return self.pattern in raw.decode("utf-8", errors="replace").lower()

    def line_starts(self, buf: bytes, stop: int) -> Iterator[int]:
        """Starts of the lines of buf[:stop] (complete lines, buf[stop - 1] == "\\n") that
        hold the pattern, in order."""
        if not self.by_bytes:
            yield from self._line_starts_text(buf, stop)
            return
        hay, i = self.hay(buf), 0
        while True:
            j = hay.find(self.needle, i, stop)
            if j < 0:
                return
            start = buf.rfind(b"\n", 0, j) + 1
            yield start
            i = buf.index(b"\n", j) + 1

    def _line_starts_text(self, buf: bytes, stop: int) -> Iterator[int]:
        """The chunk decoded and lowered once (C speed; line by line it was ~100x slower on
        short lines). Lowering keeps the line breaks (no character lowers to or from one),
        so a match's line is found in the bytes by counting them."""
        low = buf[:stop].decode("utf-8", errors="replace").lower()
        i = at = 0  # where the search goes on, in `low` and in `buf` (the same line start)
        while (j := low.find(self.pattern, i)) >= 0:
            start = _after_newlines(buf, at, low.count("\n", i, j))
            yield start
            i, at = low.index("\n", j) + 1, buf.index(b"\n", start) + 1


def _after_newlines(buf: bytes, pos: int, n: int) -> int:
    """The offset right after the `n`th line break of buf from `pos` (`pos` if n is 0), by
    counting over halving spans: about twice the distance counted, never a loop per line."""
    if n == 0:
        return pos
    hi = pos + n  # each line break takes a byte: the nth is at least this far
    while (c := buf.count(b"\n", pos, hi)) < n:
        if hi >= len(buf):
            raise ValueError("fewer line breaks than counted")
        pos, n, hi = hi, n - c, hi + 2 * (hi - pos)
    while hi - pos > 64:
        mid = (pos + hi) // 2
        c = buf.count(b"\n", pos, mid)
        if c >= n:
            hi = mid
        else:
            pos, n = mid, n - c
    for _ in range(n):
        pos = buf.index(b"\n", pos) + 1
    return pos


def lines_back(buf: bytes, base: int, end: int, n: int, keep: int) -> list[Line]:
    """The up to `n` lines of buf that end right before `end` (a line start), in order."""
    out: list[Line] = []
    while end > 0 and len(out) < n:
        start = buf.rfind(b"\n", 0, end - 1) + 1
        out.append(Line(base + start, buf[start : min(end - 1, start + keep)]))
        end = start
    out.reverse()
    return out


def lines_fwd(buf: bytes, base: int, start: int, stop: int, n: int, keep: int) -> list[Line]:
    """The up to `n` complete lines of buf[:stop] from `start` (a line start)."""
    out: list[Line] = []
    while start < stop and len(out) < n:
        end = buf.index(b"\n", start)
        out.append(Line(base + start, buf[start : min(end, start + keep)]))
        start = end + 1
    return out


class _LongLine:
    """A line longer than a chunk, searched piece by piece: its start, its first bytes (what
    an answer shows), whether the pattern was seen, and the last bytes of the last piece."""

    def __init__(self, offset: int, matcher: Matcher, keep: int):
        self.offset, self.matcher, self.keep = offset, matcher, keep
        self.head, self.tail, self.matched = b"", b"", False

    def feed(self, piece: bytes) -> None:
        if len(self.head) < self.keep:
            self.head += piece[: self.keep - len(self.head)]
        if not self.matched:
            self.matched = self.matcher.contains(self.tail + piece)
        self.tail = (self.tail + piece)[-self.matcher.overlap :]


class Scan:
    """The state of one search as chunks arrive: the unfinished last line (`carry`), the
    lines before the next one (for `before`), and the matches still owed `after` lines."""

    def __init__(
        self,
        matcher: Matcher,
        *,
        context: int,
        limit: int,
        offset: int,
        chunk_bytes: int,
        max_line_bytes: int = MAX_LINE_BYTES,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ):
        self.matcher, self.context, self.limit = matcher, context, limit
        self.chunk_bytes, self.max_answer_bytes = chunk_bytes, max_answer_bytes
        self.keep = max_line_bytes + 1
        self.matches: list[Match] = []
        self.pending: list[Match] = []  # owed after-lines
        self.before: deque[Line] = deque(maxlen=context)
        self.carry, self.carry_offset = b"", offset
        self.long: _LongLine | None = None
        self.answer_bytes = 0
        self.resume: int | None = None  # set once full: where the next request goes on
        self.context_only = False  # past the scan's end: lines only complete `after`

    @property
    def full(self) -> bool:
        return self.resume is not None

    @property
    def line_start(self) -> int:
        """Where the line being read began."""
        return self.long.offset if self.long is not None else self.carry_offset

    def seed(self, read: Reader, offset: int) -> None:
        """The lines before `offset` (from at most SEED_BYTES back), for the first match."""
        if not self.context or offset <= 0:
            return
        back = min(offset, SEED_BYTES)
        data, _ = read(offset - back, back)
        data = data[:back]
        stop = data.rfind(b"\n") + 1
        lines = lines_back(data, offset - back, stop, self.context, self.keep)
        self.before.extend(ln for ln in lines if ln.offset > offset - back or back == offset)

    def feed(self, data: bytes) -> None:
        """The next bytes of the log."""
        if self.long is not None:
            nl = data.find(b"\n")
            self.long.feed(data if nl < 0 else data[:nl])
            if nl < 0:
                self.carry_offset += len(data)
                return
            long, self.long = self.long, None
            end = self.carry_offset + nl + 1  # carry_offset: where the fed data began
            self._one_line(Line(long.offset, long.head), long.matched, end)
            data, self.carry_offset = data[nl + 1 :], end
        buf, base = self.carry + data, self.carry_offset
        stop = buf.rfind(b"\n") + 1
        self._lines(buf, base, stop)
        self.carry, self.carry_offset = buf[stop:], base + stop
        if len(self.carry) > self.chunk_bytes:  # a very long line: searched in pieces
            self.long = _LongLine(self.carry_offset, self.matcher, self.keep)
            self.long.feed(self.carry)
            self.carry = b""
        if self.long is not None:
            self.carry_offset = base + len(buf)  # where the next fed data begins

    def finish(self, size: int) -> None:
        """The end of the log: its last line, even without a line ending."""
        if self.long is not None:
            long, self.long = self.long, None
            self._one_line(Line(long.offset, long.head), long.matched, size)
        elif self.carry:
            raw, self.carry = self.carry, b""
            line = Line(self.carry_offset, raw[: self.keep])
            self._one_line(line, self.matcher.contains(raw), size)

    def _lines(self, buf: bytes, base: int, stop: int) -> None:
        """The complete lines buf[:stop], starting at log offset `base`."""
        self._owe(buf, base, stop)
        if not (self.full or self.context_only):
            for start in self.matcher.line_starts(buf, stop):
                end = buf.index(b"\n", start)
                before = lines_back(buf, base, start, self.context, self.keep)
                if len(before) < self.context:
                    before = [*self.before, *before][-self.context :]
                match = Match(Line(base + start, buf[start : min(end, start + self.keep)]), before)
                match.after = lines_fwd(buf, base, end + 1, stop, self.context, self.keep)
                self._add(match, base + end + 1)
                if self.full:
                    break
        self.before.extend(lines_back(buf, base, stop, self.context, self.keep))

    def _one_line(self, line: Line, matched: bool, end: int) -> None:
        """One line met on its own (a long line's end, the last line of the log)."""
        for m in self.pending:
            m.after.append(line)
        self._settle()
        if matched and not (self.full or self.context_only):
            self._add(Match(line, list(self.before)), end)
        self.before.append(line)

    def _owe(self, buf: bytes, base: int, stop: int) -> None:
        for m in self.pending:
            m.after += lines_fwd(buf, base, 0, stop, self.context - len(m.after), self.keep)
        self._settle()

    def _settle(self) -> None:
        self.pending = [m for m in self.pending if len(m.after) < self.context]

    def _add(self, match: Match, end: int) -> None:
        self.matches.append(match)
        if len(match.after) < self.context:
            self.pending.append(match)
        lines = [match.line, *match.before, *match.after]
        self.answer_bytes += sum(min(len(ln.raw), self.keep) for ln in lines)
        if len(self.matches) >= self.limit or self.answer_bytes >= self.max_answer_bytes:
            self.resume = end


def grep_log(
    read: Reader,
    pattern: str,
    *,
    ignore_case: bool = False,
    context: int = 2,
    offset: int = 0,
    limit_matches: int = 200,
    scan_bytes: int = 64 * 1024 * 1024,
    chunk_bytes: int | None = None,
    max_line_bytes: int = MAX_LINE_BYTES,
    max_s: float | None = None,
) -> GrepResult:
    """The lines holding `pattern` from byte `offset` on (a line start: a `next_offset`),
    within `scan_bytes`, with `context` lines around each. `max_s`: past this many seconds
    the scan stops before its next chunk (it reads one at least), `stopped_early`."""
    if not pattern or "\n" in pattern:
        raise ValueError("the pattern must be a non-empty string of one line")
    if scan_bytes < 1 or limit_matches < 1 or context < 0:
        raise ValueError("scan_bytes and limit_matches must be positive, context >= 0")
    chunk = chunk_bytes or CHUNK_BYTES
    scan = Scan(
        Matcher(pattern, ignore_case),
        context=context,
        limit=limit_matches,
        offset=offset,
        chunk_bytes=chunk,
        max_line_bytes=max_line_bytes,
    )
    deadline = None if max_s is None else time.monotonic() + max_s
    scan.seed(read, offset)
    pos, size, stopped_early = _scan(scan, read, offset, offset + scan_bytes, chunk, deadline)
    if pos >= size:
        if not scan.full:
            scan.finish(size)
        nxt = size
    elif scan.line_start <= offset and not scan.full:
        # One line is longer than the whole budget: search what was read of it and go on
        # from the middle of it (progress, whatever the line's length).
        scan.finish(pos)
        nxt = pos
    else:
        nxt = scan.line_start  # the unfinished line is the next request's first
    if scan.resume is not None:
        nxt = scan.resume
    _complete_after(scan, read, pos, size)
    scanned = max(0, pos - offset)
    return GrepResult(scan.matches, offset, nxt, size, nxt >= size, scanned, stopped_early)


def _scan(
    scan: Scan, read: Reader, pos: int, end: int, chunk: int, deadline: float | None = None
) -> tuple[int, int, bool]:
    """Feeds the log from `pos` to `end` (or its end, or until the scan is full) in chunks:
    (the position reached, the log's size at the first read, whether it stopped at
    `deadline`, checked between chunks)."""
    size = -1
    while not scan.full:
        if size >= 0 and deadline is not None and time.monotonic() > deadline:
            return pos, size, min(end, size) > pos
        want = min(chunk, end - pos) if size < 0 else min(chunk, end - pos, size - pos)
        if want <= 0:
            break
        data, now = read(pos, want)
        if size < 0:
            size = now  # the log as it was when the scan began (it may grow meanwhile)
        data = data[: max(0, min(end, size) - pos)]
        if not data:
            break
        scan.feed(data)
        pos += len(data)
    return pos, max(size, 0), False


def _complete_after(scan: Scan, read: Reader, pos: int, size: int) -> None:
    """The `after` lines the last matches are owed, read past the scan's end (at most
    AFTER_BYTES or a chunk, whichever is more: a huge line there leaves them short)."""
    if not scan.pending:
        return
    scan.context_only = True
    stop = min(size, pos + max(scan.chunk_bytes, AFTER_BYTES))
    while scan.pending and pos < stop:
        want = min(scan.chunk_bytes, stop - pos)
        data = read(pos, want)[0][:want]
        if not data:
            break
        scan.feed(data)
        pos += len(data)
    if pos >= size:
        scan.finish(size)
