"""The webhook sender: delivers the outbox (store/webhooks.py), as a thread of the scheduler
process (scheduler/process.py starts it; every wake-up of the scheduler wakes it too).

Each pass claims a batch of due deliveries under a lease, sends them at once (a thread
each), and records every try. At-least-once: a sender killed mid-send leaves its lease to
expire and the next pass (of any scheduler) sends the delivery again with the same
`X-Torchyard-Delivery`, which receivers de-duplicate by.

Each request: POST with the frozen body, `X-Torchyard-Event`, `X-Torchyard-Delivery` and
`X-Torchyard-Signature: sha256=<hex HMAC-SHA256 of the body keyed by the secret>`; any 2xx
is success, nothing else (redirects are not followed, so none leads to a refused address).
The SSRF guard: the host is resolved here, EVERY address checked (scheduler/webhook_guard.py:
public addresses only, unless TORCHYARD_WEBHOOK_ALLOW_NETWORKS allows more, never
TORCHYARD_WEBHOOK_DENY_NETWORKS), and the connection made to a checked address (the URL's
host kept as Host and TLS server name), so a name that resolves elsewhere at connect time
(DNS rebinding) changes nothing; a refused send is a failed try, with the reason."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx

from torchyard.scheduler.webhook_guard import Rule, rule_for
from torchyard.settings import Settings
from torchyard.store.db import session_scope
from torchyard.store.models import utcnow
from torchyard.store.webhooks import (
    Due,
    Outcome,
    claim_due,
    record_attempt,
    remove_ended_deliveries,
)

log = logging.getLogger(__name__)

BATCH = 16  # deliveries claimed (and sent at once) per pass
CLEAN_EVERY_S = 3600.0  # ended deliveries past TORCHYARD_WEBHOOK_RETENTION_S removed hourly
USER_AGENT = "torchyard-webhooks/1"
# (host, port) -> addresses; the seam tests replace to make a name resolve where they like.
Resolver = Callable[[str, int], list[str]]


class Refused(Exception):
    """A send the guard refused (a denied address, a bad URL): a failed try, not sent."""


def resolve(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (a literal address: itself)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def url_problem(url: str, rule: Rule) -> str | None:
    """What is wrong with a webhook URL before any lookup (the API's check at create):
    not http(s), no host, or a literal address the rule refuses."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as e:
        return f"not a valid URL ({e})"
    if parts.scheme not in ("http", "https"):
        return "must be an http:// or https:// URL"
    if not parts.hostname:
        return "must name a host"
    try:
        why = rule.refusal(parts.hostname)
    except ValueError:
        return None  # a name: checked at each send, on what it resolves to then
    return None if why is None else f"{parts.hostname} {why}"


def pinned(url: str, rule: Rule, resolver: Resolver) -> list[str]:
    """The addresses to connect to for `url`, every one checked (Refused otherwise)."""
    problem = url_problem(url, rule)
    if problem is not None:
        raise Refused(problem)
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addresses = resolver(host, port)
    except OSError as e:
        raise Refused(f"cannot resolve {host}: {e}") from None
    if not addresses:
        raise Refused(f"{host} resolves to no address")
    for a in addresses:
        why = rule.refusal(a)
        if why is not None:
            raise Refused(f"{host} resolves to {a}, which {why}")
    return addresses


def signature(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def body_of(due: Due) -> bytes:
    """The bytes sent and signed: the same on every retry."""
    return json.dumps(due.payload, separators=(",", ":"), sort_keys=True).encode()


class Notifier:
    """The sender. `run` loops until `stop` is set; `wake` makes it look at once."""

    def __init__(self, settings: Settings, *, resolver: Resolver = resolve):
        self.settings = settings
        self.resolver = resolver
        self.rule = rule_for(settings)
        self.claimer = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"[:100]
        # Longer than one batch's sends (all at once, each bounded by the timeout).
        self.lease_s = 2 * settings.webhook_timeout_s + 5
        self._wake = threading.Event()
        self._http = httpx.Client(
            timeout=settings.webhook_timeout_s,
            follow_redirects=False,
            trust_env=False,  # a proxy would connect to the name, past the guard
            headers={"User-Agent": USER_AGENT},
        )
        self._pool = ThreadPoolExecutor(BATCH, thread_name_prefix="webhook-send")
        self._cleaned_at: float | None = None

    def wake(self) -> None:
        self._wake.set()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.clean_due()
            try:
                busy = self.pass_once() == BATCH
            except Exception as e:  # the store is away: try again next poll
                log.warning("webhook pass failed: %s", e)
                busy = False
            if not busy:
                self._wake.wait(self.settings.webhook_poll_s)
                self._wake.clear()
        self.close()

    def clean_due(self) -> int:
        """`clean` once every CLEAN_EVERY_S (the first time at the first pass)."""
        now = time.monotonic()
        if self._cleaned_at is not None and now - self._cleaned_at < CLEAN_EVERY_S:
            return 0
        self._cleaned_at = now
        return self.clean()

    def clean(self) -> int:
        """Remove the deliveries that ended past the retention (never raises: the next
        hour tries again). Returns how many were removed."""
        keep_s = self.settings.webhook_retention_s
        if keep_s <= 0:
            return 0
        removed = 0
        try:
            while True:  # in bounded transactions, until none is left
                with session_scope(self.settings.db_url) as s:
                    n = remove_ended_deliveries(s, keep_s)
                removed += n
                if n == 0:
                    break
        except Exception as e:
            log.warning("removing old webhook deliveries failed: %s", e)
        if removed:
            log.info("removed %d webhook deliveries older than %gs", removed, keep_s)
        return removed

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def pass_once(self) -> int:
        """Claim a batch, send it (all at once) and record every try in one transaction;
        returns how many were claimed."""
        with session_scope(self.settings.db_url) as s:
            batch = claim_due(s, self.claimer, self.lease_s, BATCH)
        if not batch:
            return 0
        outcomes = list(self._pool.map(self.send, batch))
        base = self.settings.webhook_retry_base_s
        try:
            with session_scope(self.settings.db_url) as s:
                states = [
                    record_attempt(s, d, self.claimer, o, base)
                    for d, o in zip(batch, outcomes, strict=True)
                ]
        except Exception as e:  # the leases expire and the deliveries are sent again
            log.warning("could not record %d webhook deliveries: %s", len(batch), e)
            return len(batch)
        for due, outcome, state in zip(batch, outcomes, states, strict=True):
            if not outcome.ok:
                log.info("webhook delivery %s %s: %s", due.id, state, outcome.error)
        return len(batch)

    def send(self, due: Due) -> Outcome:
        """One try at `due`, never raising: what the receiver answered, or why not."""
        started, t0 = utcnow(), time.monotonic()
        code, error = None, None
        try:
            code = self._post(due)
            if not 200 <= code < 300:
                error = f"HTTP {code}"
        except Refused as e:
            error = f"refused: {e}"
        except httpx.HTTPError as e:
            error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        return Outcome(started, int((time.monotonic() - t0) * 1000), code, error)

    def _post(self, due: Due) -> int:
        addresses = pinned(due.url, self.rule, self.resolver)
        url = httpx.URL(due.url)
        body = body_of(due)
        headers = {
            "Host": url.netloc.decode("ascii").rsplit("@", 1)[-1],
            "Content-Type": "application/json",
            "X-Torchyard-Event": due.event,
            "X-Torchyard-Delivery": due.id,
            "X-Torchyard-Signature": signature(due.secret, body),
        }
        ext = {"sni_hostname": url.host} if url.scheme == "https" else {}
        last: httpx.ConnectError | None = None
        for address in addresses:  # the next checked address if one does not connect
            request = self._http.build_request(
                "POST", url.copy_with(host=address), content=body, headers=headers,
                extensions=ext,
            )  # fmt: skip
            try:
                response = self._http.send(request, stream=True)
            except httpx.ConnectError as e:
                last = e
                continue
            response.close()  # the body is never read: a receiver cannot make us buffer
            return response.status_code
        assert last is not None
        raise last
