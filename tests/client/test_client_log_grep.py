"""`torchyard logs JOB --grep PATTERN`: printed as `grep -b` prints (OFFSET:match,
OFFSET-context, `--` between groups apart), every page of the server's search followed."""

from __future__ import annotations

from client_server import Run, Store

import torchyard.api.loggrep as loggrep
from torchyard.store.paths import LOG_FILE, job_dir


def _job_with_log(store: Store, data: bytes) -> str:
    job = store.job("alice", state="succeeded")
    path = job_dir(store.settings.storage, job) / LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return job


LINES = [f"line {i}" + (" ERROR" if i in (3, 4, 10, 30) else "") for i in range(40)]
LOG = "".join(ln + "\n" for ln in LINES).encode()


def _at(i: int) -> int:
    return LOG.index(LINES[i].encode() + b"\n")


def test_grep_prints_like_grep_b(run: Run, store: Store) -> None:
    job = _job_with_log(store, LOG)
    rc, out, _ = run("logs", job, "--grep", "error", "-i", "--context", "1")
    assert rc == 0
    want = [f"{_at(2)}-line 2", f"{_at(3)}:line 3 ERROR", f"{_at(4)}:line 4 ERROR",
            f"{_at(5)}-line 5", "--", f"{_at(9)}-line 9", f"{_at(10)}:line 10 ERROR",
            f"{_at(11)}-line 11", "--", f"{_at(29)}-line 29", f"{_at(30)}:line 30 ERROR",
            f"{_at(31)}-line 31"]  # fmt: skip
    assert out.splitlines() == want
    rc, out, _ = run("logs", job, "--grep", "ERROR", "-C", "0")
    assert out.splitlines() == [f"{_at(i)}:{LINES[i]}" for i in (3, 4, 10, 30)]


def test_every_page_is_followed(run: Run, store: Store, http: object, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A scan budget of 1 KiB over a 30 KB log: the matches of every page, in order."""
    app = http.app  # type: ignore[attr-defined]
    app.state.settings = app.state.settings.model_copy(update={"log_grep_scan_bytes": 1024})
    monkeypatch.setattr(loggrep, "CHUNK_BYTES", 100)
    lines = [f"{i:05d} " + ("hit" if i % 50 == 7 else "...") for i in range(3000)]
    data = "".join(ln + "\n" for ln in lines).encode()
    job = _job_with_log(store, data)
    rc, out, _ = run("logs", job, "--grep", "hit", "-C", "0")
    assert rc == 0
    assert out.splitlines() == [f"{i * 10}:{ln}" for i, ln in enumerate(lines) if "hit" in ln]


def test_no_match_is_exit_1_and_grep_does_not_follow(run: Run, store: Store) -> None:
    job = _job_with_log(store, LOG)
    rc, out, err = run("logs", job, "--grep", "nothing like it")
    assert rc == 1 and out == "" and "no line" in err
    rc, _, err = run("logs", job, "--grep", "x", "--follow")
    assert rc == 2 and "--follow" in err
