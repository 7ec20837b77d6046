"""A real webhook receiver for the delivery tests (tests/scheduler) and the fault suite's
notifications (tests/chaos): an `http.server` on a free port of 127.0.0.1 in a thread,
keeping every request (path, headers, body, arrival time). What it answers depends on the
path: `/ok` 200; `/flaky` 500 to a delivery's first two tries, then 200; `/hold` keeps the
first request open for HOLD_S (the test kills the sender meanwhile), then 200 to
everything; `/redirect` 302 to `/ok`."""

from __future__ import annotations

import hashlib
import hmac
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HOLD_S = 4.0


@dataclass(frozen=True)
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float  # time.time()

    @property
    def delivery(self) -> str:
        return self.headers.get("x-torchyard-delivery", "")

    def signed_by(self, secret: str) -> bool:
        want = "sha256=" + hmac.new(secret.encode(), self.body, hashlib.sha256).hexdigest()
        return hmac.compare_digest(want, self.headers.get("x-torchyard-signature", ""))


class Receiver:
    def __init__(self) -> None:
        self.got: list[Received] = []
        self.lock = threading.Lock()
        self.held = threading.Event()
        self._tries: Counter[str] = Counter()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_: Any) -> None:
                pass

            def do_POST(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n)
                headers = {k.lower(): v for k, v in self.headers.items()}
                status = receiver.record(Received(self.path, headers, body, time.time()))
                self.send_response(status)
                if status == 302:
                    self.send_header("Location", "/ok")
                self.send_header("Content-Length", "0")
                self.end_headers()

        class Server(ThreadingHTTPServer):
            request_queue_size = 128  # socketserver's 5 would drop concurrent connects

        self.server = Server(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def record(self, r: Received) -> int:
        with self.lock:
            self.got.append(r)
            self._tries[r.delivery] += 1
            tries = self._tries[r.delivery]
        if r.path == "/flaky":
            return 500 if tries <= 2 else 200
        if r.path == "/redirect":
            return 302
        if r.path == "/hold" and not self.held.is_set():
            self.held.set()
            time.sleep(HOLD_S)
        return 200

    def received(self, path: str | None = None) -> list[Received]:
        with self.lock:
            return [r for r in self.got if path is None or r.path == path]


@contextmanager
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    r._thread.start()
    try:
        yield r
    finally:
        r.server.shutdown()
        r.server.server_close()
