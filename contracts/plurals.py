"""Counts in words: `plural(1, "worker")` is "1 worker", `plural(2, "worker")` "2 workers".
One helper for every count a person reads (the CLI's lines, `torchyard up`'s, the
scheduler's pending reasons), so none says "1 workers"."""

from __future__ import annotations


def plural(n: int, word: str, many: str | None = None) -> str:
    """`n` and `word`, with an `s` unless `n` is 1 (`many`: a plural that is not `word`+s,
    as "series")."""
    return f"{n} {word}" if n == 1 else f"{n} {many or word + 's'}"
