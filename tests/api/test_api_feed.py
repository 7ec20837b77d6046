"""Loss curves over HTTP, the live event stream (SSE) with Last-Event-ID, and workers."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from fastapi.testclient import TestClient
from support.db import Factory

from torchyard.settings import Settings
from torchyard.store.checkpoints import record_checkpoint
from torchyard.store.db import session_scope
from torchyard.store.metrics import ingest_metrics
from torchyard.store.paths import LOG_FILE, job_dir


def _points(name: str, steps: range, f: Any = lambda k: 1.0 / (k + 1)) -> list[dict[str, Any]]:
    return [{"name": name, "step": k, "epoch": k / 100, "value": f(k), "time": 1.0} for k in steps]


def _events(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.strip().split("\n\n"):
        fields: dict[str, Any] = {}
        for line in block.splitlines():
            if line.startswith(":"):
                continue
            k, _, v = line.partition(": ")
            fields[k] = v
        if "event" in fields:
            fields["data"] = json.loads(fields["data"])
            out.append(fields)
    return out


def test_metrics_route_shapes(
    client: TestClient, factory: Factory, alice: dict[str, str], db_url: str
) -> None:
    job = factory.job("alice", state="running")
    spike = 500
    with session_scope(db_url) as s:
        ingest_metrics(
            s, job, _points("train/loss", range(2000), lambda k: 99.0 if k == spike else 1.0)
        )
        ingest_metrics(s, job, _points("val/loss", range(0, 2000, 500)))
    url = f"/v1/jobs/{job}/metrics"
    everything = client.get(url, headers=alice).json()
    assert set(everything) == {"series"}
    assert set(everything["series"]) == {"train/loss", "val/loss"}
    assert set(everything["series"]["val/loss"]) == {"steps", "values"}  # no min/max raw
    assert everything["series"]["val/loss"]["steps"] == [0, 500, 1000, 1500]
    after = client.get(url, params={"name": "train/loss", "after_step": 1996}, headers=alice).json()
    assert after["series"]["train/loss"] == {"steps": [1997, 1998, 1999], "values": [1.0] * 3}
    both = client.get(url + "?name=train/loss,val/loss&max_points=10", headers=alice).json()
    rep = client.get(url + "?name=train/loss&name=val/loss&max_points=10", headers=alice).json()
    assert both == rep
    loss = both["series"]["train/loss"]
    assert set(loss) == {"steps", "values", "min", "max"}
    assert len(loss["steps"]) <= 10 and loss["steps"][-1] == 1999
    assert max(loss["max"]) == 99.0 and min(loss["min"]) == 1.0  # the spike survives
    assert 99.0 not in loss["values"]
    missing = client.get(url, params={"name": "nope"}, headers=alice).json()
    assert missing == {"series": {"nope": {"steps": [], "values": []}}}
    assert client.get(url, params={"max_points": 0}, headers=alice).status_code == 422
    err = client.get(url, params={"max_points": "many"}, headers=alice).json()["error"]
    assert err["details"][0]["field"] == "max_points" and "max_points" in err["message"]


def test_event_stream_of_a_finished_job_and_resume(
    client: TestClient, factory: Factory, alice: dict[str, str], db_url: str
) -> None:
    job = factory.job("alice", state="running")
    with session_scope(db_url) as s:
        ingest_metrics(s, job, _points("train/loss", range(3)))
        record_checkpoint(
            s, job, attempt=1, step=2, epoch=0.1, path="checkpoints/step-00000002.pt",
            bytes=10, sha256="a" * 64,
        )  # fmt: skip
    factory.set_state(job, "succeeded")
    r = client.get(f"/v1/jobs/{job}/events", headers=alice)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    status, *events = _events(r.text)
    # first what has no id: no pending reason, no log file
    assert status["event"] == "status" and "id" not in status
    assert status["data"] == {"pending_reason": None, "log_size": 0}
    kinds = [e["event"] for e in events]
    assert kinds.count("metric") == 3 and kinds.count("checkpoint") == 1
    states = [e["data"]["state"] for e in events if e["event"] == "state"]
    assert states == ["queued", "starting", "running", "succeeded"]
    assert kinds[-1] == "end" and events[-1]["data"] == {"state": "succeeded"}
    assert events[0]["data"] == {
        "name": "train/loss",
        "step": 0,
        "epoch": 0.0,
        "value": 1.0,
        "time": 1.0,
    }
    ck = next(e for e in events if e["event"] == "checkpoint")["data"]
    assert ck["step"] == 2 and ck["sha256"] == "a" * 64 and ck["kind"] == "resume"
    ids = [e["id"] for e in events]
    assert len(set(ids[:-1])) == len(ids) - 1  # each event its own id
    # resume after the second event: exactly the rest comes again
    status, *resumed = _events(
        client.get(f"/v1/jobs/{job}/events", headers=alice | {"Last-Event-ID": ids[1]}).text
    )
    assert status["event"] == "status"
    assert [e["id"] for e in resumed] == ids[2:]
    bad = client.get(f"/v1/jobs/{job}/events", headers=alice | {"Last-Event-ID": "x"})
    assert bad.status_code == 422


def test_event_stream_follows_a_running_job(
    client: TestClient, factory: Factory, alice: dict[str, str], db_url: str
) -> None:
    job = factory.job("alice", state="running")
    done = threading.Event()

    def trainer() -> None:  # what a worker writes while the stream is open
        for k in range(5):
            with session_scope(db_url) as s:
                ingest_metrics(s, job, _points("train/loss", range(k, k + 1)))
        factory.set_state(job, "succeeded")
        done.set()

    seen: list[dict[str, Any]] = []
    with client.stream("GET", f"/v1/jobs/{job}/events", headers=alice) as r:
        buf = ""
        started = False
        for chunk in r.iter_text():
            buf += chunk
            if not started and "event: state" in buf:
                started = True
                threading.Thread(target=trainer, daemon=True).start()
        seen = _events(buf)
    assert done.wait(10)
    assert [e["data"]["step"] for e in seen if e["event"] == "metric"] == [0, 1, 2, 3, 4]
    assert [e["event"] for e in seen][-2:] == ["state", "end"]


def test_status_events_follow_the_pending_reason_and_the_log(
    client: TestClient, factory: Factory, alice: dict[str, str], db_url: str, settings: Settings
) -> None:
    job = factory.job("alice", state="queued")
    log = job_dir(settings.storage, job) / LOG_FILE
    steps: list[Callable[[], None]] = [
        lambda: factory.set_pending(job, "needs 2 workers, 1 idle"),
        lambda: (log.parent.mkdir(parents=True, exist_ok=True), log.write_text("loading\n")),
        lambda: log.write_text("loading\nready\n"),
        lambda: factory.set_state(job, "cancelled"),
    ]
    seen: list[dict[str, Any]] = []
    with client.stream("GET", f"/v1/jobs/{job}/events", headers=alice) as r:
        buf = ""
        for chunk in r.iter_text():
            buf += chunk
            seen = _events(buf)
            statuses = [e for e in seen if e["event"] == "status"]
            # each change is its own event: the next one only once this one was seen
            if steps and len(statuses) == 5 - len(steps):
                steps.pop(0)()
    statuses = [e["data"] for e in seen if e["event"] == "status"]
    assert statuses == [
        {"pending_reason": None, "log_size": 0},
        {"pending_reason": "needs 2 workers, 1 idle", "log_size": 0},
        {"pending_reason": "needs 2 workers, 1 idle", "log_size": 8},
        {"pending_reason": "needs 2 workers, 1 idle", "log_size": 14},
        {"pending_reason": None, "log_size": 14},  # cancelled: no reason to wait any more
    ]
    assert all("id" not in e for e in seen if e["event"] == "status")
    assert seen[-1]["event"] == "end"


def test_workers_list(client: TestClient, factory: Factory, alice: dict[str, str]) -> None:
    factory.worker("gpu-host-0", device="cuda", device_name="NVIDIA H100", memory_bytes=80 << 30)
    factory.worker("cpu-1", gpu=None, device="cpu")
    body = client.get("/v1/workers", headers=alice).json()
    assert body["next_cursor"] is None
    assert [w["id"] for w in body["items"]] == ["cpu-1", "gpu-host-0"]
    w = body["items"][1]
    assert set(w) == {
        "id", "host", "pid", "gpu", "device", "device_name", "memory_bytes", "state",
        "current_job_id", "last_heartbeat", "registered_at",
    }  # fmt: skip
    assert w["gpu"] == 0 and w["device_name"] == "NVIDIA H100" and w["state"] == "idle"
