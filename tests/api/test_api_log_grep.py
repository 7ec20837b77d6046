"""`GET /v1/jobs/{id}/logs?grep=`: the server-side log search through the route (the
search itself against a reference: test_loggrep.py). Matches with their byte offsets and
context, ignore_case, paging by `next_offset` under a small scan budget and small chunks
(a match split across two chunks), a very long line, `rank` on an object store, who may
search (404), and every bad parameter a 422 naming it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support.db import Factory

import torchyard.api.loggrep as loggrep
from torchyard.settings import Settings
from torchyard.store.paths import LOG_FILE, job_dir


def _log(settings: Settings, job: str, data: bytes) -> None:
    path = job_dir(settings.storage, job) / LOG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _grep(client: TestClient, job: str, h: dict[str, str], **params: Any) -> dict[str, Any]:
    r = client.get(f"/v1/jobs/{job}/logs", params=params, headers=h)
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


LOG = b"".join(
    b"step %d loss %s%s\n" % (i, b"0.5", b" Warning: slow" if i in (4, 9) else b"")
    for i in range(12)
)


@pytest.fixture
def job(factory: Factory, settings: Settings) -> str:
    job = factory.job("alice", state="running")
    _log(settings, job, LOG)
    return job


def test_matches_with_offsets_and_context(
    client: TestClient, alice: dict[str, str], job: str
) -> None:
    body = _grep(client, job, alice, grep="warning: slow", ignore_case=True, context=1)
    assert [m["text"] for m in body["matches"]] == [
        "step 4 loss 0.5 Warning: slow",
        "step 9 loss 0.5 Warning: slow",
    ]
    first = body["matches"][0]
    assert LOG[first["offset"] :].startswith(b"step 4 loss")
    assert first["before"] == [{"offset": LOG.index(b"step 3"), "text": "step 3 loss 0.5"}]
    assert first["after"] == [{"offset": LOG.index(b"step 5"), "text": "step 5 loss 0.5"}]
    assert first["cut"] is False
    assert body["complete"] is True and body["next_offset"] == body["size"] == len(LOG)
    assert body["scanned"] == len(LOG) and body["offset"] == 0
    # case matters unless asked; the default context is 2 lines
    assert _grep(client, job, alice, grep="warning")["matches"] == []
    two = _grep(client, job, alice, grep="Warning")["matches"][1]
    assert [c["text"] for c in two["before"]] == ["step 7 loss 0.5", "step 8 loss 0.5"]
    assert [c["text"] for c in two["after"]] == ["step 10 loss 0.5", "step 11 loss 0.5"]
    assert _grep(client, job, alice, grep="Warning", context=0)["matches"][0]["before"] == []


def test_paging_through_a_budget_and_chunks_that_split_a_match(
    client: TestClient,
    alice: dict[str, str],
    app: Any,
    factory: Factory,
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 4 KiB scan budget and 64-byte chunks over a 36 KB log: every match exactly once,
    across requests, including ones whose pattern straddles a chunk boundary."""
    monkeypatch.setattr(loggrep, "CHUNK_BYTES", 64)
    app.state.settings = app.state.settings.model_copy(update={"log_grep_scan_bytes": 4096})
    job = factory.job("alice", state="succeeded")
    lines = [b"%05d %s" % (i, b"NEEDLE here" if i % 7 == 0 else b"filler text") for i in range(2000)]  # fmt: skip
    data = b"\n".join(lines) + b"\n"
    _log(settings, job, data)
    want = [data.index(ln) for ln in lines if b"NEEDLE" in ln]
    # the first page's reads start at 0: some pattern lies across one of its chunk ends
    assert any(o + 6 < k < o + 12 for o in want if o < 4096 for k in range(64, 4096, 64))
    got: list[int] = []
    offset, pages = 0, 0
    while True:
        body = _grep(client, job, alice, grep="NEEDLE", offset=offset, limit_matches=50)
        assert body["scanned"] <= 4096
        got += [m["offset"] for m in body["matches"]]
        pages += 1
        if body["complete"]:
            break
        assert body["next_offset"] > offset
        offset = body["next_offset"]
    assert got == want
    assert pages >= len(data) // 4096


def test_a_search_past_its_time_answers_what_it_found_and_where_to_go_on(
    client: TestClient, alice: dict[str, str], app: Any, job: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _grep(client, job, alice, grep="Warning")["stopped_early"] is False
    monkeypatch.setattr(loggrep, "CHUNK_BYTES", 64)
    app.state.settings = app.state.settings.model_copy(update={"log_grep_max_s": 1e-9})
    found, offset, stopped = [], 0, 0
    while True:
        body = _grep(client, job, alice, grep="Warning", offset=offset)
        assert body["scanned"] <= 64  # one chunk, then the time bound
        found += [m["offset"] for m in body["matches"]]
        stopped += body["stopped_early"]
        if body["complete"]:
            break
        offset = body["next_offset"]
    assert found == [LOG.index(b"step 4"), LOG.index(b"step 9")]
    assert stopped >= 2


def test_a_very_long_line_is_cut_and_found(
    client: TestClient, alice: dict[str, str], factory: Factory, settings: Settings
) -> None:
    job = factory.job("alice", state="running")
    long = b"a" * 5_000_000 + b" needle " + b"b" * 100
    _log(settings, job, b"first\n" + long + b"\nlast\n")
    r = client.get(f"/v1/jobs/{job}/logs", params={"grep": "needle", "context": 1}, headers=alice)
    assert r.status_code == 200
    (m,) = r.json()["matches"]
    assert m["offset"] == 6 and m["cut"] is True and m["text"] == "a" * 4096
    assert [c["text"] for c in m["before"]] == ["first"]
    assert [c["text"] for c in m["after"]] == ["last"]
    assert len(r.content) < 20_000


def test_rank_on_an_object_store(
    client: TestClient,
    alice: dict[str, str],
    factory: Factory,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torchyard.api.routers.job_data as route
    from torchyard.storage import job_key
    from torchyard.storage.memory import MemoryStorage

    job = factory.job("alice", state="running", world_size=2)
    store = MemoryStorage(tmp_path / "scratch")
    monkeypatch.setattr(route, "storage_for", lambda _settings: store)
    store.append(job_key(job, "output.log"), b"rank zero ok\n")
    store.append(job_key(job, "output.rank1.log"), b"x\nrank one NaN loss\n")
    assert _grep(client, job, alice, grep="NaN")["matches"] == []
    (m,) = _grep(client, job, alice, grep="NaN", rank=1)["matches"]
    assert m["text"] == "rank one NaN loss" and m["offset"] == 2
    bad = client.get(f"/v1/jobs/{job}/logs", params={"grep": "x", "rank": 2}, headers=alice)
    assert bad.status_code == 422 and bad.json()["error"]["details"][0]["field"] == "rank"


def test_no_log_yet(client: TestClient, alice: dict[str, str], factory: Factory) -> None:
    job = factory.job("alice", state="queued")
    body = _grep(client, job, alice, grep="x")
    assert body["matches"] == [] and body["size"] == 0


def test_another_users_job_is_404(
    client: TestClient, bob: dict[str, str], alice: dict[str, str], job: str
) -> None:
    r = client.get(f"/v1/jobs/{job}/logs", params={"grep": "loss"}, headers=bob)
    assert r.status_code == 404
    assert client.get(f"/v1/jobs/{job}/logs", params={"grep": "loss"}).status_code == 401


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"grep": ""}, "grep"),
        ({"grep": "a\nb"}, "grep"),
        ({"grep": "x" * 1001}, "grep"),
        ({"grep": "x", "context": 21}, "context"),
        ({"grep": "x", "context": -1}, "context"),
        ({"grep": "x", "limit_matches": 0}, "limit_matches"),
        ({"grep": "x", "limit_matches": 1001}, "limit_matches"),
        ({"grep": "x", "ignore_case": "maybe"}, "ignore_case"),
        ({"grep": "x", "offset": -5}, "offset"),
    ],
)
def test_bad_parameters_are_422_naming_the_field(
    client: TestClient, alice: dict[str, str], job: str, params: dict[str, Any], field: str
) -> None:
    r = client.get(f"/v1/jobs/{job}/logs", params=params, headers=alice)
    assert r.status_code == 422, r.text
    assert [d["field"] for d in r.json()["error"]["details"]] == [field]
