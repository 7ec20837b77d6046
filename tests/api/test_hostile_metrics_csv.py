"""Hostile CSV (issue 42): a job names its metrics, and the CSV export of them is opened in
a spreadsheet. A name that starts like a formula (`=HYPERLINK(…)`, `+`, `-`, `@`, a tab, a
carriage return) arrives quoted with a leading `'`, as OWASP advises; a name that is a
plain number and every number column stay as they are; a name holding a lone CR stays one
cell (no row of its own, which would start with whatever follows). The same for the
client's --csv."""

from __future__ import annotations

import csv
import io

import pytest
from fastapi.testclient import TestClient
from support.db import Factory

from torchyard.client.cmd_results import write_csv
from torchyard.store.db import session_scope
from torchyard.store.metrics import ingest_metrics

pytestmark = pytest.mark.hostile

FORMULAS = ['=HYPERLINK("http://x","y")', "+1+cmd|' /C calc'!A0", "-2+3", "@SUM(A1)",
            "\t=1", "\r=1"]  # fmt: skip


def test_formula_names_are_quoted_and_numbers_stay_numbers(
    client: TestClient, alice: dict[str, str], factory: Factory, db_url: str
) -> None:
    job = factory.job("alice", state="running")
    names = [*FORMULAS, "-0.5", "train/loss", 'x\r=HYPERLINK("http://x","y")']
    rows = [{"name": n, "step": 1, "epoch": -0.5, "value": -2.0, "time": 5.0} for n in names]
    with session_scope(db_url) as s:
        ingest_metrics(s, job, rows)
    r = client.get(f"/v1/jobs/{job}/metrics", params={"format": "csv"}, headers=alice)
    assert r.status_code == 200, r.text
    got = {row[0]: row[1:] for row in list(csv.reader(io.StringIO(r.text, newline="")))[1:]}
    assert set(got) == {"'" + f for f in FORMULAS} | set(names[len(FORMULAS) :])
    assert all(cells == ["1", "-0.5", "-2.0", "5.0"] for cells in got.values())


def test_the_clients_csv_quotes_them_too() -> None:
    out = io.StringIO()
    write_csv({n: {"steps": [1], "values": [-0.5]} for n in [*FORMULAS, "-1"]}, out)
    header, row = list(csv.reader(io.StringIO(out.getvalue(), newline="")))
    assert header == ["step", *("'" + n if n in FORMULAS else n for n in sorted([*FORMULAS, "-1"]))]
    assert row == ["1", *["-0.5"] * (len(FORMULAS) + 1)]
