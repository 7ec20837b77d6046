"""Appendable objects on an object store (storage/s3.py), which has no append: a job's log
and events grow by *pieces*, one object per append, `<K>.pieces/<start:016d>-<end:016d>`
holding the object's bytes [start, end).

Readers see the pieces as one object: one LIST of `<K>.pieces/`, then the *chain* from
offset 0, at each offset the piece that starts there with the largest end (a compacted
piece wins over the pieces it covers, which may still be there); its end is the object's
size. A piece deleted between the LIST and its GET (a compaction raced the reader) is
re-listed and read again.

One appender per key at a time (the host whose worker owns that log or events file): it
keeps the key's end and its pieces in memory, found by one LIST on its first append, so an
append is one PUT. Compaction keeps the LIST and the GETs short: after COMPACT_EVERY pieces
since the last compaction, or once the pieces after the first outweigh it, the appender
merges a run of pieces into one (read back, then put; multipart when large) and deletes
those it covers. The run merged is the shortest tail of the chain that keeps each piece
larger than everything after it, so a long log is not copied whole every COMPACT_EVERY
appends: a piece is copied O(log n) times, and the chain stays O(log n) + COMPACT_EVERY
pieces long.
"""

from __future__ import annotations

import io
import logging
import re
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Protocol, cast

__all__ = [
    "COMPACT_EVERY",
    "PIECES",
    "Listed",
    "ObjectIO",
    "Piece",
    "PieceLog",
    "chain",
    "piece_name",
    "split_piece",
]

log = logging.getLogger(__name__)

PIECES = ".pieces/"
COMPACT_EVERY = 256  # pieces an appender writes before it compacts, at the most
RELIST_TRIES = 5  # a piece gone between a LIST and its GET: list again, this many times
_PIECE = re.compile(r"^(.+)\.pieces/(\d{16})-(\d{16})$")


@dataclass(frozen=True)
class Listed:
    """One stored object as a LIST shows it."""

    name: str  # the object's full name in the bucket
    size: int
    mtime: float


@dataclass(frozen=True)
class Piece:
    start: int
    end: int
    name: str
    mtime: float = 0.0

    @property
    def size(self) -> int:
        return self.end - self.start


def piece_name(base: str, start: int, end: int) -> str:
    """The object holding bytes [start, end) of the appendable object `base`."""
    return f"{base}{PIECES}{start:016d}-{end:016d}"


def split_piece(name: str) -> tuple[str, Piece] | None:
    """(the appendable object's name, the piece) for a piece's object name; else None."""
    m = _PIECE.match(name)
    if m is None:
        return None
    start, end = int(m[2]), int(m[3])
    return (m[1], Piece(start, end, name)) if end >= start else None


def chain(pieces: Iterable[Piece]) -> list[Piece]:
    """The pieces that make the object, from offset 0: at each offset the one starting
    there that reaches furthest. [] when no piece starts at 0."""
    best: dict[int, Piece] = {}
    for p in pieces:
        if p.start not in best or p.end > best[p.start].end:
            best[p.start] = p
    out: list[Piece] = []
    at = 0
    while (step := best.get(at)) is not None:
        out.append(step)
        if step.end == at:  # an empty piece: an object of no bytes yet
            break
        at = step.end
    return out


class ObjectIO(Protocol):
    """What the pieces need of the store (storage/s3.py's client side)."""

    def list_names(self, prefix: str) -> Iterator[Listed]: ...

    def get_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object `name`; FileNotFoundError when it is gone."""
        ...

    def put_piece(self, name: str, src: BinaryIO, size: int) -> None: ...

    def delete_names(self, names: list[str]) -> None: ...

    def adopt(self, base: str) -> int | None:
        """A whole object stored at `base` made the first piece (its size); None if none."""
        ...


@dataclass
class _Appending:
    """What an appender knows of one key: its chain, and how much it wrote since the last
    compaction."""

    pieces: list[Piece]
    written: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def end(self) -> int:
        return self.pieces[-1].end if self.pieces else 0


class PieceLog:
    """Appendable objects as pieces, read and written through `store`."""

    def __init__(self, store: ObjectIO) -> None:
        self.store = store
        self._keys: dict[str, _Appending] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ reading

    def pieces(self, base: str) -> list[Piece]:
        """The chain of `base` from one LIST ([] when it has no pieces)."""
        found: list[Piece] = []
        for item in self.store.list_names(base + PIECES):
            split = split_piece(item.name)
            if split is not None and split[0] == base:
                p = split[1]
                found.append(Piece(p.start, p.end, p.name, item.mtime))
        return chain(found)

    def read(self, base: str, start: int, limit: int) -> tuple[bytes, int] | None:
        """(bytes [start, start+limit), the size) from the chain; None when no pieces."""
        for _ in range(RELIST_TRIES):
            got = self.pieces(base)
            if not got:
                return None
            try:
                return self._gather(got, start, limit), got[-1].end
            except FileNotFoundError:
                continue  # compacted meanwhile: the new chain has the bytes
        raise FileNotFoundError(base)

    def _gather(self, pieces: list[Piece], start: int, limit: int) -> bytes:
        stop = min(start + max(0, limit), pieces[-1].end)
        out = []
        for p in pieces:
            lo, hi = max(start, p.start), min(stop, p.end)
            if lo < hi:
                out.append(self.store.get_range(p.name, lo - p.start, hi - p.start))
        return b"".join(out)

    def stream(self, base: str, pieces: list[Piece], start: int, length: int | None) -> BinaryIO:
        """The chain's bytes from `start` (at most `length`), read a piece at a time."""
        raw = _PieceReader(self, base, pieces, start, length)
        return cast(BinaryIO, io.BufferedReader(raw, 1 << 20))

    # ------------------------------------------------------------------ writing

    def _state(self, base: str) -> _Appending:
        with self._lock:
            state = self._keys.get(base)
            if state is None:
                state = self._keys[base] = _Appending([])
                state.written = -1  # not looked up yet
            return state

    def append(self, base: str, data: bytes) -> None:
        """Add `data` as a new piece (the first append of a key lists what is there)."""
        state = self._state(base)
        with state.lock:
            if state.written < 0:
                self._load(base, state)
            if not data and state.pieces:
                return
            start = state.end
            name = piece_name(base, start, start + len(data))
            self.store.put_piece(name, io.BytesIO(data), len(data))
            empty = state.pieces.pop() if state.pieces and not state.pieces[-1].size else None
            state.pieces.append(Piece(start, start + len(data), name))
            state.written += 1
            try:
                if empty is not None:  # the piece that made an empty object: covered now
                    self.store.delete_names([empty.name])
                if self._due(state):
                    self._compact(base, state)
            except OSError as e:  # the append itself is stored: compact next time
                log.warning("compacting %s: %s", base, e)

    def _load(self, base: str, state: _Appending) -> None:
        state.pieces = self.pieces(base)
        if not state.pieces:
            size = self.store.adopt(base)  # appending to an object written whole
            if size is not None:
                state.pieces = [Piece(0, size, piece_name(base, 0, size))]
        state.written = 0

    @staticmethod
    def _due(state: _Appending) -> bool:
        first = state.pieces[0].size
        rest = state.end - state.pieces[0].end
        return len(state.pieces) > 1 and (state.written >= COMPACT_EVERY or rest > first)

    def _compact(self, base: str, state: _Appending) -> None:
        """Merge the tail of the chain from the first piece that is not larger than all
        after it (at the least the pieces written since the last compaction)."""
        pieces = state.pieces
        at = max(0, len(pieces) - state.written)
        after = sum(p.size for p in pieces[at + 1 :])
        while at > 0 and pieces[at - 1].size <= after + pieces[at].size:
            after += pieces[at].size
            at -= 1
        run = pieces[at:]
        if len(run) < 2:
            state.written = 0
            return
        start, end = run[0].start, run[-1].end
        merged = piece_name(base, start, end)
        src = self.stream(base, run, start, end - start)
        with src:
            self.store.put_piece(merged, src, end - start)
        state.pieces = [*pieces[:at], Piece(start, end, merged)]
        state.written = 0
        self.store.delete_names([p.name for p in run if p.name != merged])

    def forget(self, base: str) -> None:
        """The key was written whole or deleted: the next append looks it up again."""
        with self._lock:
            self._keys.pop(base, None)


class _PieceReader(io.RawIOBase):
    """A chain's bytes as a stream: one ranged GET per piece, the next when one is used
    up; a piece gone meanwhile (compacted) is found again by a fresh LIST."""

    def __init__(
        self, log: PieceLog, base: str, pieces: list[Piece], start: int, length: int | None
    ) -> None:
        super().__init__()
        self._log, self._base, self._pieces = log, base, pieces
        end = pieces[-1].end if pieces else 0
        self._pos = min(start, end)
        self._stop = end if length is None else min(end, start + max(0, length))
        self._buf = memoryview(b"")

    def readable(self) -> bool:
        return True

    def _fill(self) -> None:
        for _ in range(RELIST_TRIES):
            p = next((p for p in self._pieces if p.start <= self._pos < p.end), None)
            if p is None:
                raise FileNotFoundError(self._base)
            hi = min(self._stop, p.end, self._pos + (8 << 20))
            try:
                self._buf = memoryview(
                    self._log.store.get_range(p.name, self._pos - p.start, hi - p.start)
                )
                return
            except FileNotFoundError:
                self._pieces = self._log.pieces(self._base)
        raise FileNotFoundError(self._base)

    def readinto(self, buffer: Any) -> int:  # any writable buffer (bytearray, memoryview)
        if self._pos >= self._stop:
            return 0
        if not self._buf:
            self._fill()
        view = memoryview(buffer).cast("B")
        n = min(len(view), len(self._buf))
        view[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        self._pos += n
        return n
