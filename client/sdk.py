"""The torchyard Python SDK: a thin, typed layer over the REST API (HTTP only, no server code).

    from torchyard.client import Client

    with Client() as ty:                      # URL/token looked up as client/config.py says
        job = ty.submit(load_spec("examples/digits.json"))
        # or with your own code: ty.submit(load_spec("train.yaml"), code="src/")
        job = ty.wait(job["id"])
        print(job["state"], ty.metrics(job["id"], name="val/accuracy"))
        ty.download(job["id"], path="digits.safetensors")

Every failure raises a subclass of `client.errors.TorchyardError`. `http=` takes an
`httpx.Client` to talk through (tests pass a `fastapi.testclient.TestClient` of the real app),
`transport=` an httpx transport. Live events come from the SSE route through httpx-sse.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote

import httpx
from httpx_sse import SSEError, connect_sse

from torchyard.client.bundle import Packed, bundle_id, pack, pack_summary
from torchyard.client.config import Connection, resolve
from torchyard.client.errors import (
    AmbiguousId,
    ChecksumError,
    Conflict,
    ConnectError,
    NotFound,
    TorchyardError,
    Unavailable,
    error_for,
)
from torchyard.client.specfile import load_spec_file
from torchyard.contracts.eventmodel import artifact_name_problem
from torchyard.contracts.states import JOB_TERMINAL

# Plain strings, as the JSON bodies carry them (the list itself is the contracts').
TERMINAL_STATES = frozenset(s.value for s in JOB_TERMINAL)
_CHUNK = 1 << 20
# The server sends a keep-alive comment every 15 s: a stream silent for longer is dead.
_SSE_READ_TIMEOUT_S = 60.0

ProgressFn = Callable[[int, int | None], None]
_FULL_ID = re.compile(r"^[0-9a-f]{32}$")
_PREFIX = re.compile(r"^[0-9a-f]{1,31}$")
# How many of the newest jobs a prefix is looked for in (the server matches full ids only).
PREFIX_SCAN = 5000
# The log's end, as an offset: the server answers with its size and no data.
_LOG_END = 2**62
_TAIL_BYTES = 4 * 1024 * 1024  # the most one logs request returns


def resolve_config(
    url: str | None = None, token: str | None = None, env: Mapping[str, str] | None = None
) -> tuple[str, str | None]:
    """Server URL and token, looked up in the order client/config.py gives."""
    conn = resolve(url, token, env)
    return conn.url, conn.token


def load_spec(path: str | Path) -> dict[str, Any]:
    """A spec file as a dict: `.yaml`/`.yml` as YAML (numbers as YAML 1.2 reads them, so
    `lr: 1e-3` is a number), anything else as JSON. Raises SpecFileError: unreadable, not
    valid (with the line, column and a caret), or not one object. See client/specfile.py."""
    return load_spec_file(path)


@dataclass(frozen=True)
class Event:
    """One server-sent event of a job: `state`, `metric`, `checkpoint` or `end`, its data
    (JSON-decoded when it can be) and its id (the resume point for `Last-Event-ID`)."""

    event: str
    data: Any
    id: str


@dataclass(frozen=True)
class Download:
    """A finished, verified download."""

    path: Path
    checkpoint: dict[str, Any]  # the record downloaded: a checkpoint's, or an artifact's
    sha256: str
    bytes: int
    resumed_from: int
    """Bytes already on disk (a `.part` file) that were kept rather than fetched again."""

    @property
    def format(self) -> str:
        """`safetensors` or `torch` (a torch.save zip), read from the file's first bytes."""
        with self.path.open("rb") as f:
            head = f.read(9)
        if head[:4] == b"PK\x03\x04":
            return "torch"
        if len(head) == 9 and head[8:9] == b"{":
            return "safetensors"
        return "torch" if self.path.suffix == ".pt" else "unknown"


class Client:
    """One connection to a torchyard API. Use as a context manager, or call `close()`."""

    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        *,
        timeout: float = 30.0,
        transport: httpx.BaseTransport | None = None,
        http: httpx.Client | None = None,
        connection: Connection | None = None,
    ) -> None:
        """`http`: an httpx.Client to send through, kept open by `close()` (its owner closes
        it); its base URL is used unless `url` is given. `transport`: for a client of our own.
        `connection`: URL and token already looked up (the CLI's, naming its flags)."""
        if connection is None:
            if http is not None and not url:
                url = str(http.base_url)
            connection = resolve(url, token, given=("Client(url=…)", "Client(token=…)"))
        self.connection = connection
        self.url, self.token = connection.url, connection.token
        self.timeout = timeout
        headers = {"Accept": "application/json", "User-Agent": "torchyard-client"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        self._owns_http = http is None
        if http is None:
            http = httpx.Client(
                base_url=self.url, headers=headers, timeout=timeout, transport=transport
            )
        else:
            http.headers.update(headers)
            if url:
                http.base_url = httpx.URL(self.url)
            self.url = str(http.base_url).rstrip("/")
        self._http = http

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------------------

    def _send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        try:
            resp = self._http.send(request, stream=stream)
        except httpx.TransportError as e:
            raise self._unreachable(e) from None
        if resp.status_code >= 400:
            if stream:
                resp.read()
                resp.close()
            raise self._error_of(resp)
        return resp

    def _unreachable(self, e: httpx.TransportError) -> ConnectError:
        if isinstance(e, httpx.TimeoutException):
            head = f"the torchyard API at {self.url} did not answer in time"
        else:
            head = f"cannot reach the torchyard API at {self.url} ({_reason(e)})"
        return ConnectError(f"{head}; {self.connection.unreachable_hint()}")

    def _error_of(self, resp: httpx.Response) -> Exception:
        """The APIError of a response; a 401 says where the token was looked for."""
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code != 401:
            return error_for(resp.status_code, body, str(resp.request.url))
        if not self.token:  # the server's advice (an HTTP header) is not the user's fix
            body = {"error": {"code": "unauthorized", "message": "no API token"}}
        return error_for(401, body, str(resp.request.url), self.connection.token_hint())

    def use_token(self, token: str) -> None:
        """Send `token` from now on (`torchyard login` asks for one when none was found)."""
        self.token = token
        self.connection = replace(self.connection, token=token, token_from="the prompt")
        self._http.headers["Authorization"] = f"Bearer {token}"

    def device_sign_in(self) -> dict:
        """Start a single sign-on for this device (RFC 8628): {device_code, user_code,
        verification_uri, verification_uri_complete, interval, expires_in}. NotFound where
        the server has no single sign-on."""
        return self._json("POST", "/v1/auth/device")

    def device_token(self, device_code: str) -> dict:
        """{token, token_id, user} once the user confirmed at the provider; until then
        BadRequest with code `authorization_pending` or `slow_down`, and at the end
        `access_denied` or `expired_token` (RFC 8628)."""
        return self._json("POST", "/v1/auth/device/token", json={"device_code": device_code})

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        params = {k: v for k, v in (kw.pop("params", None) or {}).items() if v is not None}
        resp = self._send(self._http.build_request(method, path, params=params, **kw))
        return resp.json() if resp.content else None

    # -- jobs -------------------------------------------------------------------------------

    def submit(
        self,
        spec: Mapping[str, Any],
        code: str | Path | None = None,
        *,
        idempotency_key: str | None = None,
        on_packed: Callable[[Packed, int, bool], None] | None = None,
        rerun_of: str | None = None,
    ) -> dict:
        """POST the spec; returns the new job (or, with the same idempotency key, the old one).

        `code`: a directory to run the job with. It is packed into a bundle (the same tree
        gives the same bundle id), uploaded unless the server already has it from you, and
        named as the spec's `code.bundle` (in a copy: `spec` is left as it was).
        `rerun_of`: the (full) id of the job this one re-runs, recorded with the new job."""
        body = self._full_init(spec)
        if code is not None:
            body["code"] = {"bundle": self.push_code(code, on_packed=on_packed)}
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        params = {"rerun_of": rerun_of}
        return self._json("POST", "/v1/jobs", json=body, headers=headers, params=params)

    def _full_init(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """A copy of the spec whose `init.from_job`, when a unique prefix of one of your
        jobs' ids (as every command takes), is that job's full id (the API stores ids)."""
        body = dict(spec)
        init = body.get("init")
        ref = init.get("from_job") if isinstance(init, Mapping) else None
        if isinstance(ref, str) and _PREFIX.match(ref):
            try:
                full = self.resolve_job_id(ref)
            except NotFound as e:
                raise NotFound(e.status, e.code, f"init.from_job: {e.message}", e.details) from None
            body["init"] = {**init, "from_job": full}  # type: ignore[dict-item]
        return body

    def job(self, job_id: str) -> dict:
        """The job. Here and in every method that takes a job id, a unique prefix of the id
        will do (NotFound when none matches, AmbiguousId when several do)."""
        return self._json("GET", f"/v1/jobs/{self._jid(job_id)}")

    def jobs(
        self,
        *,
        state: str | Sequence[str] | None = None,
        limit: int | None = None,
        cursor: str | None = None,
        tag: str | None = None,
        archived: str | None = None,
        project: str | None = None,
    ) -> dict:
        """One page: {"items": [...], "next_cursor": ...}, newest first; `state` one state or
        several (jobs in any of them); `tag`: only jobs with it; `archived`: "true" (only
        archived jobs) or "any" (both; default: archived jobs left out); `project`: only
        that project's jobs."""
        states = [state] if isinstance(state, str) else list(state or [])
        params = {"state": states or None, "limit": limit, "cursor": cursor, "tag": tag,
                  "archived": archived, "project": project}  # fmt: skip
        return self._json("GET", "/v1/jobs", params=params)

    def iter_jobs(
        self,
        *,
        state: str | Sequence[str] | None = None,
        page_size: int = 50,
        archived: str | None = None,
    ) -> Iterator[dict]:
        """Every job, following the cursor across pages."""
        cursor = None
        while True:
            page = self.jobs(state=state, limit=page_size, cursor=cursor, archived=archived)
            yield from page.get("items", [])
            cursor = page.get("next_cursor")
            if not cursor:
                return

    def resolve_job_id(self, ref: str) -> str:
        """A full job id as it is (no request); otherwise the one job among your newest
        PREFIX_SCAN whose id starts with `ref`."""
        if _FULL_ID.match(ref):
            return ref
        if not _PREFIX.match(ref):
            raise _not_found(f"not a job id: {ref!r} (32 hex digits, or a unique prefix)")
        jobs = self.iter_jobs(page_size=500, archived="any")  # an archived job is still yours
        return match_prefix("job", ref, jobs, PREFIX_SCAN)

    _jid = resolve_job_id

    def cancel(self, job_id: str) -> dict:
        """Cancel the job (idempotent). A job that already succeeded or failed raises
        Conflict saying so (`details["state"]` is its state)."""
        job_id = self._jid(job_id)
        try:
            return self._json("POST", f"/v1/jobs/{job_id}/cancel")
        except Conflict as e:
            state = e.details.get("state") if isinstance(e.details, dict) else None
            if state not in TERMINAL_STATES:
                raise
            raise Conflict(
                e.status, e.code, f"job {job_id} already {state}: nothing to cancel", e.details
            ) from None

    # -- organising jobs: tags, notes, archive, delete, re-run ---------------------------------

    def edit_job(self, job_id: str, **fields: Any) -> dict:
        """Change the job's `tags` (the whole new list) and/or `notes` (None or "" clears);
        returns the job. Members and owners of its project may (Forbidden otherwise)."""
        return self._json("PATCH", f"/v1/jobs/{self._jid(job_id)}", json=fields)

    def tag(self, job_id: str, *, add: Sequence[str] = (), remove: Sequence[str] = ()) -> dict:
        """Add and remove tags (the others are kept, in their order); returns the job."""
        job_id = self._jid(job_id)
        tags = [t for t in self.job(job_id).get("tags") or [] if t not in set(remove)]
        tags += [t for t in dict.fromkeys(add) if t not in tags]
        return self.edit_job(job_id, tags=tags)

    def archive(self, job_id: str, *, undo: bool = False) -> dict:
        """Hide the job from default lists (`undo`: show it again); returns the job."""
        action = "unarchive" if undo else "archive"
        return self._json("POST", f"/v1/jobs/{self._jid(job_id)}/{action}")

    def delete_job(self, job_id: str) -> None:
        """Delete an ended job, its records and files, for good. Conflict while it has not
        ended (cancel it first); Forbidden unless you own its project or submitted it."""
        self._json("DELETE", f"/v1/jobs/{self._jid(job_id)}")

    def rerun(self, job_id: str, changes: Mapping[str, Any] | None = None) -> dict:
        """Submit the job's spec again with `changes` ({dotted path: value}, e.g.
        {"optimizer.lr": 0.01}) set in it; the new job records which job it re-runs."""
        job_id = self._jid(job_id)
        spec = rerun_spec(self.job(job_id), changes or {})
        return self.submit(spec, rerun_of=job_id)

    def wait(
        self,
        job_id: str,
        *,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
        on_update: Callable[[dict], None] | None = None,
    ) -> dict:
        """Poll until the job reaches succeeded, failed or cancelled; returns the final job."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        job_id = self._jid(job_id)
        while True:
            job = self.job(job_id)
            if on_update:
                on_update(job)
            if job.get("state") in TERMINAL_STATES:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.get('state')} after {timeout_s}s")
            time.sleep(poll_s)

    # -- metrics, logs, events --------------------------------------------------------------

    def metrics(
        self,
        job_id: str,
        *,
        name: str | list[str] | None = None,
        after_step: int | None = None,
        max_points: int | None = None,
    ) -> dict[str, dict[str, list]]:
        """{name: {"steps": [...], "values": [...] (, "min", "max")}}; several names are
        fetched one request each and merged. Raw points (no `max_points`) come from the
        server in pages: every page is fetched and joined."""
        names: list[str | None] = [name] if isinstance(name, str) else [*name] if name else [None]
        series: dict[str, dict[str, list]] = {}
        job_id = self._jid(job_id)
        for n in names:
            after = after_step
            while True:
                body = self._json(
                    "GET",
                    f"/v1/jobs/{job_id}/metrics",
                    params={"name": n, "after_step": after, "max_points": max_points},
                )
                for k, page in body.get("series", {}).items():
                    got = series.setdefault(k, {key: [] for key in page})
                    for key, vals in page.items():
                        got.setdefault(key, []).extend(vals)
                after = body.get("next_after_step")
                if after is None:
                    break
        return series

    def metric_pages(
        self, job_id: str, *, name: str | list[str] | None = None
    ) -> Iterator[dict[str, dict[str, list]]]:
        """Every raw point of the job's series (all of them, or `name`), one server page at a
        time as the server cut it ({name: {"steps", "values", "times"}}, every series of a
        page cut at the same step), following `next_after_step`: an export of a
        million-point job never holds it whole."""
        job_id = self._jid(job_id)
        after: int | None = None
        names = [name] if isinstance(name, str) else name
        while True:
            body = self._json(
                "GET",
                f"/v1/jobs/{job_id}/metrics",
                params={"name": names, "after_step": after, "times": "true"},
            )
            yield body.get("series", {})
            after = body.get("next_after_step")
            if after is None:
                return

    def grep_logs(
        self,
        job_id: str,
        pattern: str,
        *,
        ignore_case: bool = False,
        context: int = 2,
        offset: int = 0,
        limit_matches: int | None = None,
        rank: int = 0,
    ) -> Iterator[dict]:
        """A search of the job's log on the server (a fixed string, not a regex): each
        answer ({"matches": [{"offset", "text", "cut", "before", "after"}], "next_offset",
        "size", "scanned", "complete"}) in turn, following `next_offset` until the end of
        the log (as it was when each request began)."""
        job_id = self._jid(job_id)
        while True:
            params: dict[str, Any] = {
                "grep": pattern,
                "ignore_case": "true" if ignore_case else "false",
                "context": context,
                "offset": offset,
                "limit_matches": limit_matches,
                "rank": rank or None,
            }
            body = self._json("GET", f"/v1/jobs/{job_id}/logs", params=params)
            yield body
            nxt = int(body.get("next_offset", offset))
            if body.get("complete") or nxt <= offset:
                return
            offset = nxt

    def logs(
        self, job_id: str, *, offset: int = 0, limit: int | None = None, rank: int = 0
    ) -> dict:
        """{"data", "offset", "next_offset", "size", "complete"}: a window of the job's log
        (`rank`: another rank's own log, for a job of several ranks on an object store)."""
        params: dict[str, int | None] = {"offset": offset, "limit": limit}
        if rank:
            params["rank"] = rank
        return self._json("GET", f"/v1/jobs/{self._jid(job_id)}/logs", params=params)

    def log_tail(self, job_id: str, lines: int, *, rank: int = 0) -> dict:
        """The log's last `lines` lines (of its last 4 MiB at most): {"data", "next_offset"},
        `next_offset` being where `follow_logs` goes on from."""
        job_id = self._jid(job_id)
        size = int(self.logs(job_id, offset=_LOG_END, limit=1, rank=rank).get("size") or 0)
        want = 64 * 1024
        while True:
            start = max(0, size - want)
            chunk = self.logs(job_id, offset=start, limit=max(1, size - start), rank=rank)
            text = _last_lines(chunk.get("data") or "", lines, start == 0, want >= _TAIL_BYTES)
            if text is not None:
                return {"data": text, "next_offset": int(chunk.get("next_offset", size))}
            want = min(want * 4, _TAIL_BYTES)

    def follow_logs(
        self, job_id: str, *, offset: int = 0, poll_s: float = 1.0, rank: int = 0
    ) -> Iterator[str]:
        """The log's text as it grows, until the job has ended and everything was read."""
        job_id = self._jid(job_id)
        while True:
            chunk = self.logs(job_id, offset=offset, rank=rank)
            if chunk.get("data"):
                yield chunk["data"]
            offset = int(chunk.get("next_offset", offset))
            if chunk.get("complete") and offset >= int(chunk.get("size", offset)):
                return
            if not chunk.get("data"):
                time.sleep(poll_s)

    def events(self, job_id: str, *, last_event_id: str | None = None) -> Iterator[tuple[str, Any]]:
        """Server-sent events of one job as (event, data) pairs over one connection, after
        `last_event_id` if given. Ends when the server closes the stream."""
        for ev in self._sse(job_id, last_event_id):
            yield ev.event, ev.data

    def stream_events(
        self,
        job_id: str,
        *,
        last_event_id: str | None = None,
        reconnect_for_s: float = 180.0,
        on_retry: Callable[[TorchyardError], None] | None = None,
    ) -> Iterator[Event]:
        """Every event of the job until its `end` event (the last one yielded). A dropped
        connection (or a 503) is reopened with `Last-Event-ID`, so nothing is lost or seen
        twice, for up to `reconnect_for_s` of failures in a row; a stream that never opened
        fails at once (a wrong URL is not retried). `on_retry` hears each failure."""
        last, lost_since, opened = last_event_id, None, False
        job_id = self._jid(job_id)

        def on_open() -> None:
            nonlocal opened, lost_since
            opened, lost_since = True, None

        while True:
            try:
                for ev in self._sse(job_id, last, on_open):
                    last = ev.id or last
                    yield ev
                    if ev.event == "end":
                        return
                error: TorchyardError = ConnectError("the event stream closed before its end")
            except (ConnectError, Unavailable) as e:
                error = e
            lost_since = lost_since or time.monotonic()
            if not opened or time.monotonic() - lost_since > reconnect_for_s:
                raise error
            if on_retry:
                on_retry(error)
            delay = self.reconnect_delay_s
            time.sleep(self._server_retry_s if delay is None else delay)

    reconnect_delay_s: float | None = None
    """Seconds between reconnects of `stream_events`; None: the server's `retry:`."""
    _server_retry_s = 2.0

    def _sse(
        self, job_id: str, last_event_id: str | None, on_open: Callable[[], None] | None = None
    ) -> Iterator[Event]:
        """One connection to the job's event stream (httpx-sse); keep-alives and `retry:`
        lines are consumed here."""
        headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
        timeout = httpx.Timeout(self.timeout, read=_SSE_READ_TIMEOUT_S)
        url = f"/v1/jobs/{self._jid(job_id)}/events"
        try:
            with connect_sse(self._http, "GET", url, headers=headers, timeout=timeout) as src:
                if src.response.status_code >= 400:
                    src.response.read()
                    raise self._error_of(src.response)
                if on_open:
                    on_open()
                for sse in src.iter_sse():
                    if sse.retry is not None:
                        self._server_retry_s = sse.retry / 1000
                    if sse.event == "message" and not sse.data:
                        continue  # only a `retry:` line
                    yield Event(sse.event, _decode(sse.data), sse.id)
        except httpx.TransportError as e:
            raise self._unreachable(e) from None
        except SSEError as e:
            raise ConnectError(f"{self.url} did not answer with an event stream ({e})") from None

    # -- checkpoints ------------------------------------------------------------------------

    def checkpoints(self, job_id: str) -> list[dict]:
        return self._json("GET", f"/v1/jobs/{self._jid(job_id)}/checkpoints").get("items", [])

    def checkpoint(self, job_id: str, checkpoint: str | int = "latest") -> dict:
        """One checkpoint's record. `latest` is the one of the highest step, the final
        weights export winning a tie (it is what a user wants to load); `weights` the final
        weights; `step:N` the checkpoint of step N (its weights export winning a tie);
        `id:N` the checkpoint of id N; a bare number N is a step or an id, whichever one
        the job has (both, naming different checkpoints: an error asking which)."""
        job_id = self._jid(job_id)
        every = self.checkpoints(job_id)
        # Records whose file keep_last already deleted cannot be downloaded.
        items = [c for c in every if c.get("available", True)]
        ref = str(checkpoint).strip()
        listed = ", ".join(f"step {c.get('step')} (id {c['id']}, {c.get('kind')})" for c in items)
        listed = listed or "none"

        def best(cs: list[dict]) -> dict | None:
            return max(cs, key=lambda c: (c.get("step", 0), c.get("kind") == "weights", c["id"]),
                       default=None)  # fmt: skip

        if ref == "latest":
            if not items:
                raise _not_found(f"job {job_id} has no checkpoint yet")
            return best(items)  # type: ignore[return-value]
        if ref == "weights":
            found = best([c for c in items if c.get("kind") == "weights"])
            if found is None:
                raise _not_found(f"job {job_id} has no final weights yet; available: {listed}")
            return found
        kind, _, num = ref.partition(":") if ":" in ref else ("", "", ref)
        if kind not in ("", "step", "id") or not num.isdigit():
            raise _not_found(f"not a checkpoint: {ref!r} (latest, weights, a step, step:N or id:N)")
        by_id = next((c for c in items if str(c["id"]) == num), None) if kind != "step" else None
        by_step = best([c for c in items if str(c.get("step")) == num]) if kind != "id" else None
        if by_id is not None and by_step is not None and by_id["id"] != by_step["id"]:
            raise _not_found(
                f"{num} is both checkpoint id {num} (step {by_id.get('step')}) and step {num} "
                f"(id {by_step['id']}) of job {job_id}: say id:{num} or step:{num}"
            )
        if by_id is not None or by_step is not None:
            return by_id or by_step  # type: ignore[return-value]
        what = f"step {num}" if kind == "step" else f"id {num}" if kind == "id" else num
        if kind != "step" and any(str(c["id"]) == num for c in every):
            raise _not_found(
                f"checkpoint {num} is no longer on disk (checkpoint.keep_last); available: {listed}"
            )
        raise _not_found(f"no checkpoint {what} in job {job_id}; available: {listed}")

    def download(
        self,
        job_id: str,
        checkpoint: str | int = "latest",
        path: str | Path | None = None,
        *,
        on_progress: ProgressFn | None = None,
    ) -> Download:
        """Download a checkpoint to `path` and verify its sha256.

        Bytes go to `<path>.part` first; a `.part` left by a broken download is resumed with
        `Range` (and `If-Range` = the checkpoint's ETag, so a changed file restarts from zero).
        The file is renamed to `path` only once its sha256 matches the server's."""
        job_id = self._jid(job_id)
        ckpt = self.checkpoint(job_id, checkpoint)
        url = f"/v1/jobs/{self._jid(job_id)}/checkpoints/{_seg(str(ckpt['id']))}/download"
        dest = _destination(path, default_filename(job_id, ckpt))
        return self._verified_download(url, dest, ckpt, on_progress)

    def _verified_download(
        self, url: str, dest: Path, record: dict, on_progress: ProgressFn | None
    ) -> Download:
        """`url` into `dest` through `<dest>.part` (resumed if one is there), renamed only
        once its sha256 is `record`'s."""
        expected = str(record["sha256"]).lower()
        part = dest.with_name(dest.name + ".part")
        dest.parent.mkdir(parents=True, exist_ok=True)
        have = part.stat().st_size if part.exists() else 0
        # A .part that is not a prefix of this file fails the hash; then one clean retry.
        for attempt in (1, 2):
            resumed = self._fetch(url, part, have, expected, record.get("bytes"), on_progress)
            digest = _sha256_file(part)
            if digest == expected:
                part.replace(dest)
                return Download(dest, record, digest, dest.stat().st_size, resumed)
            part.unlink(missing_ok=True)
            if attempt == 2 or resumed == 0:
                raise ChecksumError(
                    f"sha256 of the downloaded file is {digest}, the server announced {expected}"
                )
            have = 0
        raise AssertionError("unreachable")

    # -- artifacts --------------------------------------------------------------------------

    def artifacts(self, job_id: str) -> list[dict]:
        """The files the job kept with `job.save_artifact` (name, bytes, sha256, ...)."""
        return self._json("GET", f"/v1/jobs/{self._jid(job_id)}/artifacts").get("items", [])

    def download_artifact(
        self,
        job_id: str,
        name: str,
        path: str | Path | None = None,
        *,
        on_progress: ProgressFn | None = None,
    ) -> Download:
        """Download the artifact `name` to `path` (default: `./<name>`; a directory: the
        name in it) and verify its sha256, resumable as `download` is."""
        job_id = self._jid(job_id)
        items = self.artifacts(job_id)
        found = next((a for a in items if a.get("name") == name), None)
        if found is None:
            listed = ", ".join(str(a.get("name")) for a in items) or "none"
            raise _not_found(f"job {job_id} has no artifact {name!r}; available: {listed}")
        if problem := artifact_name_problem(name):  # a file name, never a path
            raise _not_found(problem)
        url = f"/v1/jobs/{job_id}/artifacts/{_seg(name)}/download"
        return self._verified_download(url, _destination(path, name), found, on_progress)

    def _from_store(self, redirect: httpx.Response, have: int) -> httpx.Response:
        """Follow a download's redirect to its object store's presigned URL: a request of
        its own, with no token (the URL is its own credential) and no If-Range (the store's
        ETag is not the sha256; the hash check after the download catches a changed file)."""
        location = str(redirect.url.join(redirect.headers["location"]))
        redirect.close()
        headers = {"Range": f"bytes={have}-"} if have else {}
        plain = httpx.Client(timeout=httpx.Timeout(30.0, read=120.0))
        try:
            resp = plain.send(plain.build_request("GET", location, headers=headers), stream=True)
        except httpx.TransportError as e:
            plain.close()
            raise ConnectError(f"cannot reach the object store ({_reason(e)})") from None
        if resp.status_code >= 400:
            resp.read()
            plain.close()
            raise error_for(resp.status_code, None, location.split("?")[0])
        resp.extensions["torchyard_client"] = plain  # closed with the response below
        return resp

    def _fetch(
        self,
        url: str,
        part: Path,
        have: int,
        etag: str,
        total: int | None,
        on_progress: ProgressFn | None,
    ) -> int:
        """Stream into `part` from byte `have`; returns how many bytes were kept from before."""
        headers = {"Accept": "*/*"}
        if have:
            headers["Range"] = f"bytes={have}-"
            headers["If-Range"] = f'"{etag}"'
        req = self._http.build_request(
            "GET", url, headers=headers, timeout=httpx.Timeout(30.0, read=120.0)
        )
        try:
            resp = self._send(req, stream=True)
            if resp.status_code in (302, 303, 307, 308) and "location" in resp.headers:
                resp = self._from_store(resp, have)
        except Exception as e:
            # 416: the .part already holds the whole file (or more): let the hash decide.
            if getattr(e, "status", None) == 416:
                return have
            raise
        try:
            if resp.status_code == 206:
                mode, kept = "ab", have
            else:  # 200: the server sent the whole file (no range support, or the file changed)
                mode, kept = "wb", 0
            length = resp.headers.get("Content-Length")
            size = kept + int(length) if length is not None else total
            done = kept
            if on_progress:
                on_progress(done, size)
            with part.open(mode) as f:
                try:
                    for chunk in resp.iter_bytes():  # as received: a break loses nothing
                        f.write(chunk)
                        done += len(chunk)
                        if on_progress:
                            on_progress(done, size)
                except httpx.TransportError as e:
                    raise ConnectError(
                        f"download interrupted after {done} bytes ({_reason(e)}); "
                        "run the same command again to resume"
                    ) from None
                f.flush()
                os.fsync(f.fileno())
            return kept
        finally:
            resp.close()
            if (plain := resp.extensions.get("torchyard_client")) is not None:
                plain.close()

    # -- code bundles -----------------------------------------------------------------------

    def push_code(
        self,
        directory: str | Path,
        *,
        on_packed: Callable[[Packed, int, bool], None] | None = None,
    ) -> str:
        """Pack `directory` into a bundle and make sure the server has it from this user:
        asked first, uploaded only when it is not there (404). Returns the bundle id.
        `on_packed(summary, compressed bytes, uploaded)` hears what went up."""
        data = pack(Path(directory))
        bid = bundle_id(data)
        try:
            self.bundle(bid)
            uploaded = False
        except NotFound:
            self.upload_bundle(data)
            uploaded = True
        if on_packed is not None:
            on_packed(pack_summary(Path(directory), data), len(data), uploaded)
        return bid

    def upload_bundle(self, data: bytes) -> dict:
        """POST a packed bundle (a gzip-compressed tar); {"id", "bytes", "files"}."""
        headers = {"Content-Type": "application/gzip"}
        return self._json("POST", "/v1/bundles", content=data, headers=headers)

    def bundle(self, bundle_id: str) -> dict:
        """{"id", "bytes", "files"} of a bundle this user uploaded (NotFound otherwise)."""
        return self._json("GET", f"/v1/bundles/{_seg(bundle_id)}")

    # -- data sets --------------------------------------------------------------------------

    def upload_dataset(self, name: str, archive: IO[bytes], *, force: bool = False) -> dict:
        """POST an ImageFolder set (`archive`: a gzip-compressed tar of train/… and val/…,
        streamed) as imagefolder/`name` into the server's data root or object store;
        {"name", "where", "files", "classes"}. Admins."""
        headers = {"Content-Type": "application/gzip"}
        params = {"name": name, "force": "true" if force else None}
        chunks = iter(lambda: archive.read(1 << 20), b"")  # streamed: sets may be gigabytes
        return self._json("POST", "/v1/datasets", params=params, content=chunks, headers=headers)

    # -- sweeps -----------------------------------------------------------------------------

    def create_sweep(
        self,
        sweep: Mapping[str, Any],
        code: str | Path | None = None,
        *,
        on_packed: Callable[[Packed, int, bool], None] | None = None,
    ) -> dict:
        """POST a sweep (`name`, `spec`, `space`, `objective`, `trials`, `parallel`, `sampler`,
        `pruner`, `seed`); returns it. Its trials are jobs of yours, queued by the scheduler.

        `code`: a directory every trial runs with, pushed once as `submit(code=)` pushes it
        and named as the base spec's `code.bundle` (over any bundle the spec names, as
        submit does; `sweep` is left as it was). A space that varies `code` is InvalidSpec."""
        body = dict(sweep)
        if isinstance(body.get("spec"), Mapping):
            body["spec"] = self._full_init(body["spec"])
            if code is not None:
                _no_code_in_space(body.get("space"))  # before anything is uploaded
                bundle = self.push_code(code, on_packed=on_packed)
                body["spec"] = {**body["spec"], "code": {"bundle": bundle}}
        return self._json("POST", "/v1/sweeps", json=body)

    def get_sweep(self, sweep_id: str) -> dict:
        """The sweep: its state, every trial (`job_id`, `params`, `state`, `value`,
        `pruned`, …) and `best` (the complete trial with the best value, or None)."""
        return self._json("GET", f"/v1/sweeps/{_seg(sweep_id)}")

    def list_sweeps(
        self, *, state: str | None = None, limit: int | None = None, cursor: str | None = None
    ) -> dict:
        """One page: {"items": [...], "next_cursor": ...}, newest first, without trials."""
        return self._json(
            "GET", "/v1/sweeps", params={"state": state, "limit": limit, "cursor": cursor}
        )

    def cancel_sweep(self, sweep_id: str) -> dict:
        """Stop a sweep: its queued and running trials are cancelled, no new one starts."""
        return self._json("POST", f"/v1/sweeps/{_seg(sweep_id)}/cancel")

    # -- workers ----------------------------------------------------------------------------

    def workers(self) -> list[dict]:
        return self._json("GET", "/v1/workers").get("items", [])

    # -- the pool: quotas and the queue -----------------------------------------------------

    def set_quota(self, user: str, **fields: int | float | None) -> dict:
        """Change a user's quota (admins): `max_workers`, `max_queued`, `share`; None removes
        a limit (a share of None goes back to 1), a field not given is left as it is.
        Returns the whole quota: {"user", "max_workers", "max_queued", "share"}."""
        return self._json("PUT", f"/v1/users/{_seg(user)}/quota", json=fields)

    def get_quota(self, user: str = "me") -> dict:
        """A user's quota; `me` (the default) is the caller's own."""
        return self._json("GET", f"/v1/users/{_seg(user)}/quota")

    def project_quota(self, name: str) -> dict:
        """A project's quota, on top of its users' own: {"project", "max_workers",
        "max_queued", "share"} (any member, and admins)."""
        return dict(self._json("GET", f"/v1/projects/{_seg(name)}/quota"))

    def set_project_quota(self, name: str, **fields: int | float | None) -> dict:
        """Change a project's quota (admins): `max_workers`, `max_queued`, `share`; None
        removes a limit (a share of None goes back to 1), a field not given is left as it
        is. Returns the whole quota, as `project_quota`."""
        return dict(self._json("PUT", f"/v1/projects/{_seg(name)}/quota", json=fields))

    def queue(self, *, limit: int | None = None) -> dict:
        """Queued jobs in the order they would start: {"items", "counts", "usage", "unit",
        "half_life_s"}. A non-admin's items are their own jobs only (their positions are in
        the whole queue)."""
        return self._json("GET", "/v1/queue", params={"limit": limit})

    # -- API tokens -------------------------------------------------------------------------

    def tokens(self) -> list[dict]:
        """Live API tokens: your own; an admin's list has everyone's. Each is {"id", "user",
        "label", "prefix", "created_at"}: never a secret."""
        return list(self._json("GET", "/v1/tokens").get("items", []))

    def create_token(
        self,
        user: str,
        *,
        label: str | None = None,
        admin: bool = False,
        can_run_code: bool = False,
    ) -> dict:
        """A new token for `user`, created if missing (admins only): the listed fields plus
        "token", the secret, which is shown this once."""
        body = {"user": user, "label": label, "admin": admin, "can_run_code": can_run_code}
        return dict(self._json("POST", "/v1/tokens", json=body))

    def revoke_token(self, token_id: int) -> None:
        """Revoke a token by id (your own, or anyone's for an admin): refused from then on."""
        self._json("DELETE", f"/v1/tokens/{int(token_id)}")

    # -- users: permissions and single sign-on links ----------------------------------------

    def set_user(
        self, name: str, *, admin: bool | None = None, can_run_code: bool | None = None
    ) -> dict:
        """Give or take back a user's permissions (admins); None leaves one as it is. They
        are the user's: every token and session of the user has them from the next request
        on. Returns {"user", "admin", "can_run_code"}; taking admin from the last admin is
        a 409."""
        body = {
            k: v for k, v in (("admin", admin), ("can_run_code", can_run_code)) if v is not None
        }
        return dict(self._json("PATCH", f"/v1/users/{_seg(name)}", json=body))

    def link_user(self, name: str, subject: str) -> dict:
        """Link a user to their account (its `sub`) at the server's single sign-on provider
        (admins): that account then signs in as the user. Returns {"user", "issuer",
        "subject"}."""
        body = {"subject": subject}
        return dict(self._json("PUT", f"/v1/users/{_seg(name)}/identity", json=body))

    # -- projects ---------------------------------------------------------------------------

    def projects(self) -> list[dict]:
        """The projects you have a role in (an admin: every project), each {"name",
        "personal", "role", "members", "created_at"}."""
        return list(self._json("GET", "/v1/projects").get("items", []))

    def project(self, name: str) -> dict:
        """A project with its `members` ([{"user", "role"}], owners first)."""
        return dict(self._json("GET", f"/v1/projects/{_seg(name)}"))

    def create_project(self, name: str) -> dict:
        """Make a project; you become its owner."""
        return dict(self._json("POST", "/v1/projects", json={"name": name}))

    def set_member(self, project: str, user: str, role: str = "member") -> dict:
        """Give `user` a role (viewer, member, owner) in the project (its owners only)."""
        path = f"/v1/projects/{_seg(project)}/members/{_seg(user)}"
        return dict(self._json("PUT", path, json={"role": role}))

    def remove_member(self, project: str, user: str) -> dict:
        """Take `user` out of the project (its owners; anyone for themselves)."""
        return dict(self._json("DELETE", f"/v1/projects/{_seg(project)}/members/{_seg(user)}"))

    # -- the audit trail --------------------------------------------------------------------

    def audit(
        self,
        *,
        user: str | None = None,
        action: str | None = None,
        target: str | None = None,
        project: str | None = None,
        since: str | None = None,
        until: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> dict:
        """One page of the audit trail: {"items": [...], "next_cursor": ...}, newest first;
        each entry {"id", "time", "user", "action", "target", "details", "client"}. Admins
        read every entry, a project's owners its entries. `action` ending in `.` is a prefix
        (`job.`); `since`/`until` are ISO 8601 times."""
        params = {"user": user, "action": action, "target": target, "project": project,
                  "since": since, "until": until, "limit": limit, "cursor": cursor}  # fmt: skip
        return dict(self._json("GET", "/v1/audit", params=params))

    # -- webhooks ---------------------------------------------------------------------------

    def webhooks(self) -> list[dict]:
        """Your webhooks and those of the projects you own, each {"id", "url", "events",
        "project", "owner", "active", "secret" (masked), "created_at"}."""
        return list(self._json("GET", "/v1/webhooks").get("items", []))

    def create_webhook(
        self,
        url: str,
        events: Sequence[str],
        *,
        secret: str | None = None,
        project: str | None = None,
    ) -> dict:
        """A webhook POSTing `events` to `url`; the answer holds its `secret`, this once."""
        body = {"url": url, "events": list(events), "secret": secret, "project": project}
        return dict(self._json("POST", "/v1/webhooks", json={k: v for k, v in body.items() if v}))

    def resolve_webhook_id(self, ref: str) -> str:
        """A full webhook id as it is (no request); otherwise the one webhook you manage
        whose id starts with `ref` (NotFound when none does, AmbiguousId when several do)."""
        if _FULL_ID.match(ref):
            return ref
        if not _PREFIX.match(ref):
            raise _not_found(f"not a webhook id: {ref!r} (32 hex digits, or a unique prefix)")
        # The list is every webhook you manage (no pages), so no scan limit.
        return match_prefix("webhook", ref, map(_webhook_as_listed, self.webhooks()))

    def delete_webhook(self, webhook_id: str) -> None:
        """Delete the webhook; a unique prefix of its id will do."""
        self._json("DELETE", f"/v1/webhooks/{self.resolve_webhook_id(webhook_id)}")

    def webhook_deliveries(
        self, webhook_id: str, *, limit: int | None = None, cursor: str | None = None
    ) -> dict:
        """One page of a webhook's deliveries, newest first, each with its `attempts`; a
        unique prefix of the webhook's id will do."""
        params = {"limit": limit, "cursor": cursor}
        path = f"/v1/webhooks/{self.resolve_webhook_id(webhook_id)}/deliveries"
        return dict(self._json("GET", path, params=params))

    def ready(self) -> bool:
        """True when /readyz answers 200 (no token needed)."""
        try:
            return self._http.get("/readyz", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False


def rerun_spec(job: Mapping[str, Any], changes: Mapping[str, Any]) -> dict[str, Any]:
    """The spec to submit for a re-run of `job` (as GET /v1/jobs/{id} answers it): its
    stored spec, its tags (kept beside the spec, not in it), its team project (a personal
    one is left out: a re-run lands in the caller's own), then each change set at its
    dotted path. The server checks the result (422 naming a bad field)."""
    spec = copy.deepcopy(dict(job.get("spec") or {}))
    if job.get("tags") and "tags" not in spec:
        spec["tags"] = list(job["tags"])
    project = job.get("project")
    if project and not str(project).startswith("~") and "project" not in spec:
        spec["project"] = project
    for path, value in changes.items():
        set_at(spec, path, value)
    return spec


def set_at(spec: dict[str, Any], path: str, value: Any) -> None:
    """Set `value` at the dotted `path` (`optimizer.lr`, `model.hidden.0`), making the
    mappings on the way; a number indexes a list (its length appends). ValueError for a
    path that cannot be followed (an index past a list's end, an empty part)."""
    parts = path.split(".")
    if not all(parts):
        raise ValueError(f"{path!r} is not a dotted path (a.b.c)")
    node: Any = spec
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list) and part.isdigit() and int(part) <= len(node):
            k = int(part)
            if k == len(node):
                node.append(None)
            if last:
                node[k] = value
            elif not isinstance(node[k], dict | list):
                node[k] = {}
            node = node[k]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            elif not isinstance(node.get(part), dict | list):
                node[part] = {}
            node = node[part]
        else:
            where = ".".join(parts[:i]) or "the spec"
            raise ValueError(
                f"{path}: {where} is a list; {part!r} is not an index up to {len(node)}"
            )


def _destination(path: str | Path | None, name: str) -> Path:
    """Where a download goes: `path`, or `name` in it when it is a directory, or `name`."""
    if path is None:
        return Path(name)
    if str(path).endswith(("/", os.sep)) or Path(path).is_dir():  # a directory
        return Path(path) / name
    return Path(path)


def default_filename(job_id: str, ckpt: Mapping[str, Any]) -> str:
    """`<job>-step<step>.safetensors` for the weights export, `.pt` for a resume checkpoint."""
    path = str(ckpt.get("path") or "")
    if path.endswith(".safetensors") or ckpt.get("kind") == "weights":
        ext = ".safetensors"
    else:
        ext = ".pt"
    return f"{job_id[:12]}-step{int(ckpt.get('step') or 0)}{ext}"


def match_prefix(kind: str, ref: str, items: Iterable[dict], limit: int | None = None) -> str:
    """The id of the one item (a job, a sweep; at most `limit` of them are read) whose id
    starts with `ref`. None: NotFound. Several: AmbiguousId naming the first few."""
    matches: list[dict] = []
    seen = 0
    for item in itertools.islice(items, limit):
        seen += 1
        if str(item.get("id", "")).startswith(ref):
            matches.append(item)
    if len(matches) == 1:
        return str(matches[0]["id"])
    if not matches:
        among = f" among your newest {seen}" if limit is not None and seen >= limit else ""
        raise _not_found(f"no {kind} id starts with {ref}{among}")
    width = max(12, len(ref) + 4)
    listed = "; ".join(
        f"{str(m['id'])[:width]} {m.get('name')} ({m.get('state')}, created "
        f"{str(m.get('created_at') or '?')[:16].replace('T', ' ')})"
        for m in matches[:5]
    )
    more = f"; {len(matches) - 5} more" if len(matches) > 5 else ""
    raise AmbiguousId(
        f"{ref} matches {len(matches)} {kind}s: {listed}{more}; give more of the id",
        [str(m["id"]) for m in matches],
    )


def _webhook_as_listed(hook: Mapping[str, Any]) -> dict[str, Any]:
    """A webhook in the fields match_prefix names a match by: its URL and whether active."""
    state = "active" if hook.get("active", True) else "inactive"
    return {"id": hook.get("id"), "name": hook.get("url"), "state": state,
            "created_at": hook.get("created_at")}  # fmt: skip


def _not_found(message: str) -> Exception:
    return error_for(404, {"error": {"code": "not_found", "message": message}})


def _no_code_in_space(space: Any) -> None:
    """A sweep given `code=` runs that bundle in every trial; a space that varies `code`
    (or `code.bundle`) would run others: refused (422-shaped, before any upload)."""
    keys = (
        [k for k in space if str(k).split(".")[0] == "code"] if isinstance(space, Mapping) else []
    )
    if keys:
        why = "varies the code bundle, but --code (code=) runs one in every trial: use either"
        details = [{"field": f"space.{k}", "message": why} for k in keys]
        err = {"code": "validation_error", "message": "invalid sweep", "details": details}
        raise error_for(422, {"error": err})


def _last_lines(text: str, lines: int, at_start: bool, final: bool) -> str | None:
    """The last `lines` lines of `text`, the log from some offset to its end; None when
    they may begin before that offset (read more). Text from the middle of a line (the
    window's start, unless it is the log's) is never shown."""
    if lines <= 0:
        return ""
    body = text[:-1] if text.endswith("\n") else text  # the last line's own newline
    cut = len(body)
    for _ in range(lines):
        cut = body.rfind("\n", 0, cut)
        if cut < 0:
            break
    if cut >= 0:
        return text[cut + 1 :]
    if at_start:
        return text
    return text[text.find("\n") + 1 :] if final else None


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _seg(value: str) -> str:
    """A path segment: ids only, so a typo can never walk to another route."""
    if not value or "/" in value or value in (".", ".."):
        raise error_for(
            404, {"error": {"code": "not_found", "message": f"not a valid id: {value!r}"}}
        )
    return quote(value, safe="")


def _reason(e: Exception) -> str:
    text = str(e) or type(e).__name__
    if "Connection refused" in text or "Errno 111" in text:
        return "connection refused"
    return text.splitlines()[0][:200]


def _decode(data: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data
