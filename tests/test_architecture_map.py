"""docs/architecture.md's module map ("Where each thing lives") names every module of the
product, and nothing that is gone: the map is what a newcomer reads first, so a module added
without a line there, or a line left behind by a move, fails here."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
PARTS = ("api", "broker", "client", "contracts", "migrations", "scheduler", "storage", "store",
         "torchyard", "trainer", "worker")  # fmt: skip
SKIP = {"__init__.py", "__main__.py"}


def product_modules() -> set[str]:
    """`part/relative/path.py` of every module (package files and migration scripts aside)."""
    found = set()
    for part in PARTS:
        root = REPO / part
        for f in root.rglob("*.py"):
            rel = f.relative_to(root)
            if f.name in SKIP or rel.parts[0] == "versions":
                continue
            found.add(f"{part}/{rel.as_posix()}")
    return found


def mapped_modules(text: str) -> set[str]:
    """The modules the map's table names: each row's backticked `*.py` names, under the
    package of its first cell (a blank first cell continues the row above's package)."""
    section = text.split("## 2. Where each thing lives", 1)[1].split("\n## ", 1)[0]
    found, package = set(), ""
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or (set(cells[0]) <= {"-", " "} and cells[0]):
            continue
        if cells[0] == "package":
            continue
        package = cells[0] or package
        for name in re.findall(r"`([\w/]+\.py)`", cells[1]):
            found.add(f"{package}/{name}")
    return found


def test_every_module_is_on_the_map() -> None:
    missing = sorted(product_modules() - mapped_modules(DOC.read_text(encoding="utf-8")))
    assert not missing, "add these to docs/architecture.md, section 2:\n" + "\n".join(missing)


def test_the_map_names_no_module_that_is_gone() -> None:
    gone = sorted(m for m in mapped_modules(DOC.read_text(encoding="utf-8"))
                  if not (REPO / m).is_file())  # fmt: skip
    assert not gone, "docs/architecture.md, section 2, names modules that do not exist:\n" + (
        "\n".join(gone)
    )


def test_the_map_reader_reads_rows_and_continuations() -> None:
    text = (
        "## 2. Where each thing lives\n\n| package | module | holds |\n|---|---|---|\n"
        "| api | `app.py`, `routers/jobs.py` | x |\n| | `deps.py` | y |\n"
        "| store | `db.py` | z |\n\n## 3. Next\n| api | `nope.py` | |\n"
    )
    assert mapped_modules(text) == {"api/app.py", "api/routers/jobs.py", "api/deps.py",
                                    "store/db.py"}  # fmt: skip
