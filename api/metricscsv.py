"""A job's metrics as CSV (`GET /v1/jobs/{id}/metrics?format=csv`): every point of the
chosen series, one row each (name, step, epoch, value, time), streamed page by page from
the store so a million-point job is never one list in memory. Each page is read in a short
session of its own: the route's session is closed before a response streams.

A metric's name is the job's choice: one that a spreadsheet would run as a formula is
quoted (contracts/csvcells.py), and rows end in CRLF (RFC 4180), so that a name holding a
lone CR is quoted too instead of starting a row of its own."""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from sqlalchemy.orm import Session

from torchyard.contracts.csvcells import text_cell
from torchyard.store.metrics import metric_names, point_rows

CSV_COLUMNS = ("name", "step", "epoch", "value", "time")
PAGE_ROWS = 20_000  # points read per store query


@dataclass(frozen=True)
class Selection:
    """Which points: the route's parameters (None: every series, no bound)."""

    names: list[str] | None
    after_step: int | None
    min_step: int | None
    max_step: int | None


def _number(v: float | None) -> str:
    # repr: the shortest text that reads back as the same float (nan and inf as Python writes)
    return "" if v is None else repr(float(v))


def csv_lines(
    sessions: Callable[[], Session], job_id: str, sel: Selection, page: int | None = None
) -> Iterator[bytes]:
    """The CSV's bytes, a header then one chunk per page of points (PAGE_ROWS), series by
    name then step ascending."""
    page = page or PAGE_ROWS
    buf = io.StringIO()
    out = csv.writer(buf, lineterminator="\r\n")
    out.writerow(CSV_COLUMNS)
    yield buf.getvalue().encode()
    if sel.names is None:
        with sessions() as s:
            names = metric_names(s, job_id)
    else:
        names = sel.names
    for name in names:
        cell = text_cell(name)
        after = sel.after_step
        while True:
            with sessions() as s:
                rows = point_rows(
                    s, job_id, name, after_step=after, min_step=sel.min_step,
                    max_step=sel.max_step, limit=page,
                )  # fmt: skip
            if not rows:
                break
            buf.seek(0)
            buf.truncate()
            out.writerows((cell, st, _number(ep), _number(v), _number(t)) for st, ep, v, t in rows)
            yield buf.getvalue().encode()
            if len(rows) < page:
                break
            after = rows[-1][0]
