"""A text cell of a CSV export that no spreadsheet runs as a formula (OWASP, CSV
injection): text starting with `=`, `+`, `-`, `@`, a tab or a carriage return gets a
leading single quote, unless it is a plain number (`-0.5` stays a number). Job-chosen
names (a metric's) pass through it in the API's CSV and the client's `--csv`."""

from __future__ import annotations

import re

FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
_PLAIN_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")


def text_cell(value: str) -> str:
    """`value`, quoted with a leading `'` when a spreadsheet would read it as a formula."""
    if value.startswith(FORMULA_STARTS) and not _PLAIN_NUMBER.fullmatch(value):
        return "'" + value
    return value
