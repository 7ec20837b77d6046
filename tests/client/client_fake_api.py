"""An in-memory stand-in for the torchyard REST API behind httpx.MockTransport: the
shapes of docs/architecture.md, a job that advances one step per poll, and checkpoint downloads
with Range, If-Range and ETag. Used by the SDK/CLI unit tests; the e2e tests use the
real server."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import httpx


def _error(status: int, code: str, message: str, details: Any = None) -> httpx.Response:
    return httpx.Response(
        status, json={"error": {"code": code, "message": message, "details": details}}
    )


@dataclass
class FakeAPI:
    token: str = "ty_test"
    blob: bytes = b"PK\x03\x04" + bytes(range(256)) * 64
    steps: int = 4
    final_state: str = "succeeded"
    jobs: dict[str, dict] = field(default_factory=dict)
    requests: list[httpx.Request] = field(default_factory=list)
    # Set to N to break a download's connection after N bytes once.
    cut_after: int | None = None

    @property
    def sha(self) -> str:
        return hashlib.sha256(self.blob).hexdigest()

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def handle(self, req: httpx.Request) -> httpx.Response:
        self.requests.append(req)
        if req.headers.get("Authorization") != f"Bearer {self.token}":
            return _error(401, "unauthorized", "missing or invalid token")
        path, m = req.url.path, None
        if path == "/v1/jobs" and req.method == "POST":
            return self.submit(json.loads(req.content))
        if path == "/v1/jobs":
            items = sorted(self.jobs.values(), key=lambda j: j["created_at"], reverse=True)
            return httpx.Response(200, json={"items": items, "next_cursor": None})
        if path == "/v1/workers":
            w = {
                "id": "w0",
                "host": "h",
                "pid": 1,
                "gpu": None,
                "state": "idle",
                "current_job_id": None,
                "last_heartbeat": "2025-01-01T00:00:00+00:00",
            }
            return httpx.Response(200, json={"items": [w], "next_cursor": None})
        m = re.fullmatch(r"/v1/jobs/([0-9a-f]{32})(/.*)?", path)
        if not m or m.group(1) not in self.jobs:
            return _error(404, "not_found", "job not found")
        job, rest = self.jobs[m.group(1)], m.group(2) or ""
        if rest == "":
            return httpx.Response(200, json=self.advance(job))
        if rest == "/cancel":
            job["state"] = "cancelled"
            return httpx.Response(202, json=job)
        if rest == "/metrics":
            return httpx.Response(200, json={"series": self.series(job, req.url.params)})
        if rest == "/checkpoints":
            ck = {
                "id": 7,
                "step": job["progress"]["step"],
                "epoch": 1,
                "bytes": len(self.blob),
                "sha256": self.sha,
                "kind": "resume",
                "created_at": "2025-01-01T00:00:00Z",
            }
            return httpx.Response(200, json={"items": [ck], "next_cursor": None})
        if rest == "/checkpoints/7/download":
            return self.download(req)
        return _error(404, "not_found", "no such route")

    def submit(self, spec: dict) -> httpx.Response:
        lr = spec.get("optimizer", {}).get("lr")
        problems = []
        if isinstance(lr, int | float) and lr <= 0:
            problems.append({"field": "optimizer.lr", "message": "must be > 0"})
        if not isinstance(spec.get("batch_size", 1), int):
            problems.append({"field": "batch_size", "message": "must be an integer"})
        if problems:
            listed = "; ".join(f"{p['field']}: {p['message']}" for p in problems)
            return _error(422, "validation_error", f"invalid spec: {listed}", problems)
        jid = hashlib.md5(json.dumps(spec, sort_keys=True).encode()).hexdigest()
        jid = f"{len(self.jobs):02x}" + jid[2:]
        job = {
            "id": jid,
            "name": spec.get("name", "job"),
            "state": "queued",
            "attempt": 1,
            "spec": {"epochs": 2, **spec},
            "pending_reason": "no worker registered",
            "error": None,
            "created_at": f"2025-01-01T00:00:{len(self.jobs):02d}+00:00",
            "finished_at": None,
            "progress": {
                "step": 0,
                "total_steps": self.steps,
                "epoch": 0,
                "samples_per_s": None,
                "eta_s": None,
            },
            "latest_metrics": {},
            "attempts": [],
        }
        self.jobs[jid] = job
        return httpx.Response(201, json=job)

    def advance(self, job: dict) -> dict:
        """Each poll moves the job on: queued -> running (one step per poll) -> final."""
        if job["state"] == "queued":
            job["state"], job["pending_reason"] = "running", None
        elif job["state"] == "running":
            p = job["progress"]
            if p["step"] < self.steps:
                p.update(
                    step=p["step"] + 1,
                    epoch=p["step"] * 2 // self.steps,
                    samples_per_s=1000.0,
                    eta_s=float(self.steps - p["step"]),
                )
            else:
                job["state"] = self.final_state
                job["finished_at"] = "2025-01-01T00:01:00+00:00"
                job["error"] = (
                    "trainer exited with code 3" if self.final_state == "failed" else None
                )
        return job

    def series(self, job: dict, params: httpx.QueryParams) -> dict:
        after = int(params.get("after_step", -1))
        names = [params["name"]] if "name" in params else ["train/loss", "val/loss"]
        out = {}
        for n in names:
            steps = [s for s in range(1, job["progress"]["step"] + 1) if s > after]
            if n == "val/loss":
                steps = [s for s in steps if s % 2 == 0]
            out[n] = {"steps": steps, "values": [2.0 / s for s in steps]}
        return out

    def download(self, req: httpx.Request) -> httpx.Response:
        etag = f'"{self.sha}"'
        headers = {"ETag": etag, "Accept-Ranges": "bytes"}
        rng, if_range = req.headers.get("Range"), req.headers.get("If-Range")
        start = 0
        if rng and (if_range is None or if_range == etag):
            start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
            if start >= len(self.blob):
                return _error(416, "range_not_satisfiable", "range not satisfiable")
        body = self.blob[start:]
        headers["Content-Length"] = str(len(body))
        if self.cut_after is not None:
            cut, self.cut_after = self.cut_after, None
            return httpx.Response(
                200 if not start else 206, headers=headers, stream=_Broken(body[:cut])
            )
        if start:
            headers["Content-Range"] = f"bytes {start}-{len(self.blob) - 1}/{len(self.blob)}"
            return httpx.Response(206, headers=headers, content=body)
        return httpx.Response(200, headers=headers, content=body)


class _Broken(httpx.SyncByteStream):
    """A body that breaks off: the bytes it has, then a network error."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __iter__(self):
        yield self.data
        raise httpx.ReadError("connection reset by peer")
