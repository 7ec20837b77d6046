"""api/loggrep.py against a reference as plain as it gets (split the log into lines, look at
each): random logs, chunk sizes down to a few bytes (so matches, lines and context cross
chunk boundaries), scan budgets that page the search, very long lines, CRLF, ignore_case
with ASCII and non-ASCII patterns. Paging through `next_offset` must give every match
exactly once, with the context a whole-log grep gives."""

from __future__ import annotations

import random

import pytest

from torchyard.api.loggrep import GrepResult, grep_log, text

KEEP = 64  # max_line_bytes in these tests: long lines are cut


def _reader(log: bytes):  # type: ignore[no-untyped-def]
    def read(start: int, limit: int) -> tuple[bytes, int]:
        return log[start : start + limit], len(log)

    return read


def _lines(log: bytes) -> list[tuple[int, bytes]]:
    out, pos = [], 0
    for raw in log.split(b"\n"):
        out.append((pos, raw))
        pos += len(raw) + 1
    if log.endswith(b"\n") or not log:
        out.pop()  # nothing after the last line ending
    return out


def _reference(log: bytes, pattern: str, ignore_case: bool, context: int) -> list[tuple]:
    lines = _lines(log)

    def hit(raw: bytes) -> bool:
        t = raw.decode("utf-8", errors="replace")
        return pattern.lower() in t.lower() if ignore_case else pattern in t

    def show(i: int) -> tuple[int, str]:
        return lines[i][0], text(lines[i][1][: KEEP + 1], KEEP)[0]

    return [
        (
            show(i),
            [show(j) for j in range(max(0, i - context), i)],
            [show(j) for j in range(i + 1, min(len(lines), i + 1 + context))],
        )
        for i, (_, raw) in enumerate(lines)
        if hit(raw)
    ]


def _flat(r: GrepResult) -> list[tuple]:
    def show(ln):  # type: ignore[no-untyped-def]
        return ln.offset, text(ln.raw, KEEP)[0]

    return [(show(m.line), [show(x) for x in m.before], [show(x) for x in m.after]) for m in r.matches]  # fmt: skip


def _all_pages(log: bytes, pattern: str, **kw: object) -> tuple[list[tuple], int]:
    got: list[tuple] = []
    offset, pages = 0, 0
    while True:
        r = grep_log(_reader(log), pattern, offset=offset, max_line_bytes=KEEP, **kw)  # type: ignore[arg-type]
        got += _flat(r)
        pages += 1
        assert r.next_offset > offset or r.complete, "no progress"
        if r.complete:
            return got, pages
        offset = r.next_offset


WORDS = ["loss", "LOSS", "Loss", "lo", "ss", "epoch", "é", "É", "x" * 30, "", "\r", "ÉTÉ"]


def _random_log(rng: random.Random) -> bytes:
    lines = []
    for _ in range(rng.randint(0, 40)):
        if rng.random() < 0.05:
            lines.append("y" * rng.randint(100, 400) + rng.choice(["loss", ""]) + "z" * 50)
        else:
            lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6))))
    log = "\n".join(lines) + rng.choice(["\n", "", "\nloss tail"])
    return log.encode()


@pytest.mark.parametrize("seed", range(300))
def test_paged_search_equals_a_whole_log_grep(seed: int) -> None:
    rng = random.Random(seed)
    log = _random_log(rng)
    pattern = rng.choice(["loss", "Loss", "lo", "é", "été", "ss l", "x"])
    ignore_case = rng.random() < 0.5
    context = rng.choice([0, 1, 2, 5])
    kw = {
        "ignore_case": ignore_case,
        "context": context,
        "chunk_bytes": rng.choice([1, 3, 7, 16, 64, 1 << 20]),
        "limit_matches": rng.choice([1, 2, 3, 1000]),
        # a budget that never ends inside a line (those cut lines: their own test)
        "scan_bytes": rng.choice([1 << 20, max(600, len(log) // 3 + 1)]),
    }
    want = _reference(log, pattern, ignore_case, context)
    got, _ = _all_pages(log, pattern, **kw)
    assert got == want, (log, pattern, kw)


def test_a_search_past_its_time_stops_between_chunks_and_goes_on() -> None:
    """`max_s` is checked between chunks (one at least is read): what was found comes back
    with `stopped_early`, and paging from `next_offset` finds every match once."""
    log = b"".join(b"line %d%s\n" % (i, b" hit" if i % 10 == 3 else b"") for i in range(100))
    r = grep_log(_reader(log), "hit", chunk_bytes=64, max_s=0.0)
    assert r.stopped_early and not r.complete and r.scanned == 64
    assert 0 < r.next_offset <= 64 and log[r.next_offset - 1] == ord("\n")
    got, pages = _all_pages(log, "hit", chunk_bytes=64, max_s=0.0)
    assert got == _reference(log, "hit", False, 2) and pages > 10
    whole = grep_log(_reader(log), "hit", chunk_bytes=64, max_s=60.0)
    assert whole.complete and not whole.stopped_early and len(whole.matches) == 10


def test_crc_line_endings_and_context_across_chunks() -> None:
    log = b"".join(
        b"line %d%s\r\n" % (i, b" ERROR" if i in (3, 50, 51, 99) else b"") for i in range(100)
    )
    r = grep_log(_reader(log), "error", ignore_case=True, context=2, chunk_bytes=5)
    assert [text(m.line.raw)[0] for m in r.matches] == ["line 3 ERROR", "line 50 ERROR", "line 51 ERROR", "line 99 ERROR"]  # fmt: skip
    first = r.matches[0]
    assert [text(x.raw)[0] for x in first.before] == ["line 1", "line 2"]
    assert [text(x.raw)[0] for x in first.after] == ["line 4", "line 5"]
    assert log[first.line.offset :].startswith(b"line 3 ERROR")
    assert [text(x.raw)[0] for x in r.matches[3].after] == []
    assert r.complete and r.next_offset == len(log) and r.scanned == len(log)


def test_the_limit_pages_and_owed_context_is_read_past_it() -> None:
    log = b"".join(b"hit %d\n" % i for i in range(10))
    r = grep_log(_reader(log), "hit", context=3, limit_matches=4, chunk_bytes=8)
    assert len(r.matches) == 4 and not r.complete
    assert r.next_offset == log.index(b"hit 4")
    assert [text(x.raw)[0] for x in r.matches[-1].after] == ["hit 4", "hit 5", "hit 6"]
    r2 = grep_log(_reader(log), "hit", context=3, offset=r.next_offset, limit_matches=100)
    assert [text(x.raw)[0] for x in r2.matches[0].before] == ["hit 1", "hit 2", "hit 3"]
    assert len(r2.matches) == 6 and r2.complete


def test_the_budget_bounds_the_bytes_scanned() -> None:
    line = b"a" * 99 + b"\n"
    log = line * 10_000 + b"needle\n"  # ~1 MB before the only match
    offset, pages = 0, 0
    while True:
        r = grep_log(_reader(log), "needle", offset=offset, scan_bytes=100_000, chunk_bytes=4096)
        pages += 1
        assert r.scanned <= 100_000
        if r.matches:
            assert r.matches[0].line.offset == len(line) * 10_000 and r.complete
            break
        assert r.next_offset % 100 == 0, "a page ends at a line start"
        offset = r.next_offset
    assert pages == 11


def test_a_line_longer_than_a_chunk_is_searched_in_pieces() -> None:
    """A 3 MB line (no line ending for 3 MB) holding the pattern across a chunk boundary:
    found, shown cut, never held whole."""
    body = b"x" * 1_000_000 + b"NEEDLE" + b"y" * 2_000_000
    log = b"before\n" + body + b"\nafter\n"
    for chunk in (1_000_003, 65_536, 1 << 22):
        r = grep_log(_reader(log), "needle", ignore_case=True, context=1, chunk_bytes=chunk)
        (m,) = r.matches
        shown, cut = text(m.line.raw)
        assert m.line.offset == 7 and cut and shown == "x" * 4096
        assert [text(x.raw)[0] for x in m.before] == ["before"]
        assert [text(x.raw)[0] for x in m.after] == ["after"]
    assert not grep_log(_reader(log), "NEEDLE y", chunk_bytes=65_536).matches


def test_a_line_longer_than_the_budget_still_progresses() -> None:
    log = b"z" * 5000 + b"needle" + b"z" * 5000 + b"\nnext\n"
    got, offset = [], 0
    for _ in range(50):
        r = grep_log(_reader(log), "needle", offset=offset, scan_bytes=1024, chunk_bytes=256)
        got += r.matches
        if r.complete:
            break
        assert r.next_offset > offset
        offset = r.next_offset
    assert r.complete and len(got) == 1  # the pattern within one 1024-byte piece is found


def test_cut_lines_keep_whole_characters_and_bad_patterns_refuse() -> None:
    assert text("é".encode() * 3, 5) == ("éé", True)
    assert text(b"ok\r") == ("ok", False)
    assert text(b"\xff bad") == ("\ufffd bad", False)
    for bad in ("", "two\nlines"):
        with pytest.raises(ValueError):
            grep_log(_reader(b"x\n"), bad)


def test_offset_past_the_end_and_an_empty_log() -> None:
    r = grep_log(_reader(b"abc\n"), "abc", offset=100)
    assert r.matches == [] and r.complete and r.next_offset == 4
    r = grep_log(_reader(b""), "abc")
    assert r.matches == [] and r.complete and r.next_offset == 0 and r.size == 0
