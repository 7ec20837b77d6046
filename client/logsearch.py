"""`torchyard logs JOB --grep PATTERN [--ignore-case] [--context N]`: the server searches the
whole log (a fixed string, `GET /v1/jobs/{id}/logs?grep=`), the client follows its
`next_offset` to the end and prints as `grep -b` does: `OFFSET:line` for a match,
`OFFSET-line` for context, `--` between groups that do not touch, each line once."""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from torchyard.client.cli_common import EXIT_FAIL, EXIT_OK, EXIT_USAGE, err, note
from torchyard.client.sdk import Client


class _Printer:
    """Lines in order, once each (groups of neighbouring matches overlap); a context line
    that is itself a match is printed as one."""

    def __init__(self, out: TextIO, context: int):
        self.out, self.context = out, context
        self.hits: set[int] = set()  # offsets of the matches seen so far
        self.last: int | None = None  # offset of the last line printed
        self.next_start: int | None = None  # where the line after it starts, when known

    def group(self, match: dict) -> None:
        lines = [*match["before"], match, *match["after"]]
        fresh = [ln for ln in lines if self.last is None or ln["offset"] > self.last]
        if not fresh:
            return
        if self.context and self.last is not None and fresh[0]["offset"] != self.next_start:
            self.out.write("--\n")
        for ln in fresh:
            mark = ":" if ln["offset"] in self.hits else "-"
            self.out.write(f"{ln['offset']}{mark}{ln['text']}\n")
            self.last = ln["offset"]
            # Unknown for a cut line (or one that ended in \r\n): then `--` is printed.
            self.next_start = None if ln.get("cut") else ln["offset"] + len(ln["text"].encode()) + 1


def add_grep_options(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--grep",
        metavar="PATTERN",
        help="only the lines holding PATTERN (a fixed string, searched on the server), "
        "printed as OFFSET:line",
    )
    sp.add_argument("-i", "--ignore-case", action="store_true", help="--grep: ignore case")
    sp.add_argument(
        "-C", "--context", type=_context, default=2, metavar="N", help="--grep: N lines around (2)"
    )


def _context(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = -1
    if not 0 <= n <= 20:
        raise argparse.ArgumentTypeError(f"must be 0 to 20 lines, got {value!r}")
    return n


def cmd_grep(client: Client, job_id: str, args: argparse.Namespace) -> int:
    """The search, page by page. The last match of a page is printed with the next page's
    matches known, so that its `after` lines that match are marked as matches."""
    if args.follow or args.tail is not None:
        err("--grep searches the log as it is: not with --follow or --tail")
        return EXIT_USAGE
    printer = _Printer(sys.stdout, args.context)
    held: list[dict] = []
    found = 0
    for page in client.grep_logs(
        job_id,
        args.grep,
        ignore_case=args.ignore_case,
        context=args.context,
        offset=args.offset,
        rank=args.rank,
    ):
        matches = page.get("matches") or []
        if not matches:
            continue
        found += len(matches)
        printer.hits.update(m["offset"] for m in matches)
        for m in [*held, *matches[:-1]]:
            printer.group(m)
        held = matches[-1:]
        sys.stdout.flush()
    for m in held:
        printer.group(m)
    if not found:
        note(f"no line of the log holds {args.grep!r}")
        return EXIT_FAIL
    return EXIT_OK
