"""The dashboard's server side: its page and assets (caching, CSP), its logins (one-time
links, token logins, the session cookie with CSRF), the jobs table and its live stream."""

from __future__ import annotations

import gzip
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import update
from support.db import Factory

from torchyard.api.deps import CSRF_HEADER, SESSION_COOKIE
from torchyard.api.routers.ui import CSP
from torchyard.store.db import session_scope
from torchyard.store.metrics import ingest_metrics
from torchyard.store.models import ApiToken, Worker, utcnow
from torchyard.store.uijobs import changes_since, changes_start
from torchyard.store.uisessions import create_login_link, token_id_for

JS = "console.log('dashboard');\n" * 50


@pytest.fixture
def static(app: FastAPI, tmp_path: Path) -> Path:
    """A built dashboard, as scripts/build_web.sh lays it out."""
    root = tmp_path / "static"
    (root / "assets").mkdir(parents=True)
    (root / "index.html").write_text("<!doctype html><script type=module src=/assets/app-ABCD1234.js></script>")  # fmt: skip
    (root / "assets" / "app-ABCD1234.js").write_text(JS)
    (root / "assets" / "app-ABCD1234.js.gz").write_bytes(gzip.compress(JS.encode()))
    (root / "assets" / "robots.txt").write_text("x")
    app.state.ui_static = root
    return root


def test_page_and_assets(client: TestClient, static: Path) -> None:
    for path in ("/", "/jobs/0123abc", "/compare", "/workers", "/submit", "/login"):
        r = client.get(path)
        assert r.status_code == 200, path
        assert r.text.startswith("<!doctype html>")
        assert r.headers["cache-control"] == "no-cache"
        assert r.headers["content-security-policy"] == CSP
        assert "script-src 'self';" in CSP and "unsafe-inline" not in CSP
        assert r.headers["x-frame-options"] == "DENY"
    js = client.get("/assets/app-ABCD1234.js", headers={"Accept-Encoding": "identity"})
    assert js.status_code == 200 and js.text == JS
    assert js.headers["cache-control"] == "public, max-age=31536000, immutable"
    assert js.headers["content-type"].startswith("text/javascript")
    zipped = client.get("/assets/app-ABCD1234.js", headers={"Accept-Encoding": "gzip"})
    assert zipped.headers["content-encoding"] == "gzip" and zipped.text == JS  # httpx inflates
    assert int(zipped.headers["content-length"]) < len(JS) / 5
    assert client.get("/assets/robots.txt").headers["cache-control"] == "no-cache"
    for bad in ("/assets/..%2findex.html", "/assets/.hidden", "/assets/missing-ABCD1234.js"):
        assert client.get(bad).status_code == 404, bad
    assert client.get("/v1/nope").status_code == 404  # the API's paths stay the API's


def test_page_not_built(client: TestClient, app: FastAPI, tmp_path: Path) -> None:
    app.state.ui_static = tmp_path / "nothing"
    r = client.get("/")
    assert r.status_code == 503 and "build_web.sh" in r.text


def _link(client: TestClient, headers: dict[str, str]) -> str:
    r = client.post("/v1/ui/login-links", headers=headers)
    assert r.status_code == 201, r.text
    body = r.json()
    assert body["path"] == "/#login=" + body["secret"] and body["expires_in_s"] == 300
    return str(body["secret"])


def _exchange(client: TestClient, secret: str) -> Any:
    return client.post("/v1/ui/sessions", json={"login": secret})


def test_login_link_is_one_time_and_sets_a_strict_cookie(
    client: TestClient, alice: dict[str, str]
) -> None:
    secret = _link(client, alice)
    r = _exchange(client, secret)
    assert r.status_code == 201, r.text
    cookie = r.headers["set-cookie"]
    assert cookie.startswith(f"{SESSION_COOKIE}=tys_")
    low = cookie.lower()
    assert "httponly" in low and "samesite=strict" in low and "path=/" in low
    assert "secure" not in low  # plain http here; https sets Secure
    assert r.json()["user"] == "alice" and len(r.json()["csrf"]) == 64
    assert secret not in r.text and secret not in cookie
    client.cookies.clear()
    again = _exchange(client, secret)
    assert again.status_code == 401 and "already used" in again.json()["error"]["message"]
    assert _exchange(client, "tyl_" + "x" * 43).status_code == 401


def test_expired_link_and_revoked_token(
    client: TestClient, alice: dict[str, str], db_url: str
) -> None:
    token = alice["Authorization"].removeprefix("Bearer ")
    with session_scope(db_url) as s:
        tid = token_id_for(s, token)
        assert tid is not None
        expired = create_login_link(s, tid, ttl_s=-1)
    assert _exchange(client, expired).status_code == 401
    live = _link(client, alice)
    assert _exchange(client, _link(client, alice)).status_code == 201
    assert client.get("/v1/jobs").status_code == 200  # the cookie works
    with session_scope(db_url) as s:
        s.get(ApiToken, tid).revoked_at = utcnow()  # type: ignore[union-attr]
    client.app.state.token_cache.clear()  # type: ignore[attr-defined]
    assert client.get("/v1/jobs").status_code == 401  # the session ends with its token
    client.cookies.clear()
    assert _exchange(client, live).status_code == 401  # and so do its links


def test_token_login_and_what_the_cookie_may_do(
    client: TestClient, alice: dict[str, str], bob: dict[str, str], factory: Factory
) -> None:
    mine, theirs = factory.job("alice"), factory.job("bob")
    wrong = client.post("/v1/ui/sessions", json={}, headers={"Authorization": "Bearer ty_nope"})
    assert wrong.status_code == 401 and SESSION_COOKIE not in client.cookies
    form = client.post("/v1/ui/sessions", content=b"login=x", headers={**alice, "Content-Type": "text/plain"})  # fmt: skip
    assert form.status_code in (415, 422) and SESSION_COOKIE not in client.cookies
    r = client.post("/v1/ui/sessions", json={}, headers=alice)
    assert r.status_code == 201
    csrf = r.json()["csrf"]
    assert client.get("/v1/ui/session").json() == {**r.json()}
    # Authorised exactly like the token: the other user's job is a 404.
    assert client.get(f"/v1/jobs/{mine}").status_code == 200
    assert client.get(f"/v1/jobs/{theirs}").status_code == 404
    assert [j["id"] for j in client.get("/v1/jobs").json()["items"]] == [mine]
    # Changing anything with the cookie needs the CSRF token.
    assert client.post(f"/v1/jobs/{mine}/cancel").status_code == 403
    bad = client.post(f"/v1/jobs/{mine}/cancel", headers={CSRF_HEADER: "0" * 64})
    assert bad.status_code == 403 and bad.json()["error"]["code"] == "csrf"
    ok = client.post(f"/v1/jobs/{mine}/cancel", headers={CSRF_HEADER: csrf})
    assert ok.status_code == 202 and ok.json()["state"] == "cancelled"
    assert client.post(f"/v1/jobs/{theirs}/cancel", headers={CSRF_HEADER: csrf}).status_code == 404
    # A login link is made with the token, not with a session.
    assert client.post("/v1/ui/login-links", headers={CSRF_HEADER: csrf}).status_code == 403
    out = client.delete("/v1/ui/session", headers={CSRF_HEADER: csrf})
    assert out.status_code == 204 and SESSION_COOKIE not in client.cookies
    assert client.get("/v1/ui/session").status_code == 401
    assert client.get("/v1/ui/session", headers=bob).json()["csrf"] is None  # bearer: none


def test_every_ui_route_needs_a_login(client: TestClient, factory: Factory) -> None:
    job = factory.job("alice")
    for method, path in [
        ("GET", "/v1/ui/jobs"),
        ("GET", "/v1/ui/jobs/changes"),
        ("GET", f"/v1/ui/jobs/{job}/stream-start"),
        ("GET", "/v1/ui/session"),
        ("DELETE", "/v1/ui/session"),
        ("POST", "/v1/ui/login-links"),
    ]:
        assert client.request(method, path).status_code == 401, path
    client.cookies.set(SESSION_COOKIE, "tys_forged")
    assert client.get("/v1/ui/jobs").status_code == 401


def test_jobs_table(
    client: TestClient, alice: dict[str, str], admin: dict[str, str], factory: Factory, db_url: str
) -> None:
    run = factory.job("alice", state="running", spec={**_spec(), "name": "resnet 100%"})
    factory.attempt(run, workers=2)
    done = factory.job("alice", state="succeeded", spec={**_spec(), "name": "digits"})
    factory.job("bob", state="queued", spec={**_spec(), "name": "bob's digits"})
    with session_scope(db_url) as s:
        ingest_metrics(s, run, [{"name": "train/loss", "step": k, "value": 2.0 - k / 10, "time": 1.0} for k in range(5)])  # fmt: skip
        ingest_metrics(s, run, [{"name": "val/accuracy", "step": 4, "value": 0.9, "time": 1.0}])
    body = client.get("/v1/ui/jobs", headers=alice).json()
    assert [j["id"] for j in body["items"]] == [done, run]  # newest first, only alice's
    assert body["total"] == 2 and body["counts"] == {"running": 1, "succeeded": 1}
    row = body["items"][1]
    assert row["latest"] == {"train/loss": pytest.approx(1.6), "val/accuracy": 0.9}
    assert len(row["workers"]) == 2 and row["owner"] == "alice"
    by_state = client.get("/v1/ui/jobs", params={"state": "running"}, headers=alice).json()
    assert [j["id"] for j in by_state["items"]] == [run] and by_state["total"] == 1
    assert by_state["counts"] == body["counts"]  # chips count every state
    text = client.get("/v1/ui/jobs", params={"q": "100%"}, headers=alice).json()
    assert [j["id"] for j in text["items"]] == [run]  # % is a character, not a wildcard
    assert client.get("/v1/ui/jobs", params={"q": "1_0"}, headers=alice).json()["total"] == 0
    prefix = client.get("/v1/ui/jobs", params={"q": done[:6]}, headers=alice).json()
    assert [j["id"] for j in prefix["items"]] == [done]
    everyone = client.get("/v1/ui/jobs", params={"q": "bob"}, headers=admin).json()
    assert [j["owner"] for j in everyone["items"]] == ["bob"]
    paged = client.get("/v1/ui/jobs", params={"offset": 1, "limit": 1}, headers=alice).json()
    assert [j["id"] for j in paged["items"]] == [run] and paged["total"] == 2
    assert client.get("/v1/ui/jobs", params={"state": "bogus"}, headers=alice).status_code == 422


def test_a_pruned_trial_is_labelled_everywhere_a_job_shows(
    client: TestClient, alice: dict[str, str], factory: Factory, db_url: str
) -> None:
    """Its state stays cancelled; `pruned` and its sweep say why, in the dashboard's table,
    the public list and the job itself. A trial cancelled by hand is a plain cancel."""
    from torchyard.store.models import SweepTrial
    from torchyard.store.sweeps import NewSweep, create_sweep

    space = {"optimizer.lr": {"type": "categorical", "choices": [0.1, 0.01]}}
    with session_scope(db_url) as s:
        sid = create_sweep(s, factory.user_id("alice"), NewSweep(
            name="s", spec=_spec(), space=space, metric="val/accuracy", mode="max",
            max_trials=2, parallel=2, sampler="grid", pruner="asha", seed=0)).id  # fmt: skip
    pruned = factory.job("alice", state="cancelled", sweep_id=sid)
    by_hand = factory.job("alice", state="cancelled", sweep_id=sid)
    finished_first = factory.job("alice", state="succeeded", sweep_id=sid)  # before the cancel
    with session_scope(db_url) as s:
        s.add(SweepTrial(sweep_id=sid, number=0, job_id=pruned, params={}, outcome="pruned"))
        s.add(SweepTrial(sweep_id=sid, number=1, job_id=by_hand, params={}, outcome="cancelled"))
        s.add(SweepTrial(sweep_id=sid, number=2, job_id=finished_first, params={},
                         outcome="pruned"))  # fmt: skip
    table = {j["id"]: j for j in client.get("/v1/ui/jobs", headers=alice).json()["items"]}
    listed = {j["id"]: j for j in client.get("/v1/jobs", headers=alice).json()["items"]}
    for rows in (table, listed):
        assert (rows[pruned]["state"], rows[pruned]["pruned"]) == ("cancelled", True)
        assert (rows[by_hand]["state"], rows[by_hand]["pruned"]) == ("cancelled", False)
        assert (rows[finished_first]["state"], rows[finished_first]["pruned"]) == (
            "succeeded",
            False,
        )
        assert rows[pruned]["sweep_id"] == rows[by_hand]["sweep_id"] == sid
    job = client.get(f"/v1/jobs/{pruned}", headers=alice).json()
    assert (job["pruned"], job["sweep_id"]) == (True, sid)
    assert client.get(f"/v1/jobs/{by_hand}", headers=alice).json()["pruned"] is False
    assert client.get(f"/v1/jobs/{finished_first}", headers=alice).json()["pruned"] is False


def _spec() -> dict[str, Any]:
    from support.db import SPEC

    return dict(SPEC)


def test_changes_found_cheaply(factory: Factory, db_url: str) -> None:
    before = factory.job("alice", state="running")
    with session_scope(db_url) as s:
        state = changes_start(s)
        assert changes_since(s, state, time.monotonic()) == {}
    new = factory.job("bob")
    with session_scope(db_url) as s:
        ingest_metrics(s, before, [{"name": "loss", "step": 1, "value": 1.0, "time": 1.0}])
        from torchyard.store.jobs import bump_version

        bump_version(s, before)
    alice, bob = factory.user_id("alice"), factory.user_id("bob")
    with session_scope(db_url) as s:
        assert changes_since(s, state, time.monotonic()) == {new: bob, before: alice}
        assert changes_since(s, state, time.monotonic()) == {}
    factory.set_state(before, "succeeded")
    with session_scope(db_url) as s:
        assert changes_since(s, state, time.monotonic()) == {before: alice}
        # An event id missed (committed late) is looked for again, for a while.
        state.gaps[state.cursor] = time.monotonic()
        assert before in changes_since(s, state, time.monotonic())
        assert state.gaps == {}


def test_changes_stream_tells_each_user_their_own(
    client: TestClient, alice: dict[str, str], factory: Factory
) -> None:
    made: list[str] = []

    def submit() -> None:
        time.sleep(0.3)
        made.append(factory.job("bob"))
        time.sleep(0.3)
        made.append(factory.job("alice"))

    with client.stream("GET", "/v1/ui/jobs/changes", headers=alice) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        threading.Thread(target=submit, daemon=True).start()
        buf = ""
        for chunk in r.iter_text():
            buf += chunk
            if "event: changes" in buf and "\n\n" in buf.split("event: changes", 1)[1]:
                break
    data = buf.split("event: changes", 1)[1].split("data: ", 1)[1].split("\n", 1)[0]
    assert len(made) == 2 and data == '{"jobs":["' + made[1] + '"]}'  # bob's was not told


def test_changes_stream_tells_when_workers_change_but_not_on_heartbeats(
    client: TestClient, alice: dict[str, str], factory: Factory, db_url: str
) -> None:
    wid = factory.worker("w-1")
    told: list[str] = []

    def cluster() -> None:
        time.sleep(0.3)
        for _ in range(3):  # heartbeats alone: nothing the page would show differently
            with session_scope(db_url) as s:
                s.execute(update(Worker).where(Worker.id == wid).values(last_heartbeat=utcnow()))
            time.sleep(0.1)
        told.append("heartbeats")
        told.append("lost")  # before the commit: an event can only follow it
        with session_scope(db_url) as s:
            s.execute(update(Worker).where(Worker.id == wid).values(state="lost"))

    with client.stream("GET", "/v1/ui/jobs/changes", headers=alice) as r:
        threading.Thread(target=cluster, daemon=True).start()
        buf = ""
        for chunk in r.iter_text():
            buf += chunk
            if "event: workers" in buf:
                break
    assert told == ["heartbeats", "lost"]  # the event came after the loss, not before
    assert "event: workers\ndata: {}" in buf


def test_stream_start_skips_history(
    client: TestClient, alice: dict[str, str], bob: dict[str, str], factory: Factory, db_url: str
) -> None:
    job = factory.job("alice", state="running")
    with session_scope(db_url) as s:
        ingest_metrics(s, job, [{"name": n, "step": k, "value": 1.0, "time": 1.0} for n in ("a", "b") for k in range(50)])  # fmt: skip
    assert client.get(f"/v1/ui/jobs/{job}/stream-start", headers=bob).status_code == 404
    start = client.get(f"/v1/ui/jobs/{job}/stream-start", headers=alice).json()["last_event_id"]
    with session_scope(db_url) as s:
        ingest_metrics(s, job, [{"name": "a", "step": 50, "value": 2.0, "time": 1.0}])
    factory.set_state(job, "succeeded")
    text = client.get(f"/v1/jobs/{job}/events", headers={**alice, "Last-Event-ID": start}).text
    metrics = [line for line in text.splitlines() if line.startswith("event: metric")]
    assert len(metrics) == 1 and '"step":50' in text and "event: end" in text
