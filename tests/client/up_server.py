"""A real `torchyard up` (API, scheduler, 2 CPU workers: real processes) in a temporary
TORCHYARD_HOME, for the end-to-end tests. Its login file goes to a temporary
TORCHYARD_CONFIG, never the user's own."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from torchyard.client import Client

ROOT = Path(__file__).resolve().parents[2]
READY_S = 120.0
JOB_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(home: Path, config: Path) -> dict[str, str]:
    """Only this home's embedded defaults: no database, broker, storage or login from
    outside."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHYARD_")}
    return env | {
        "TORCHYARD_HOME": str(home),
        "TORCHYARD_CONFIG": str(config),
        "PYTHONUNBUFFERED": "1",
    }


@dataclass
class Up:
    home: Path
    port: int
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    runs: int = 0

    @classmethod
    def in_temp(cls, tmp: Path) -> Up:
        home = tmp / "home"
        home.mkdir(parents=True, exist_ok=True)
        return cls(home, free_port(), clean_env(home, tmp / "config.json"))

    @property
    def log(self) -> Path:
        return self.home / f"up-{self.runs}.out"

    @property
    def config(self) -> Path:
        return Path(self.env["TORCHYARD_CONFIG"])

    def start(self) -> None:
        self.runs += 1
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "torchyard", "up", "--workers", "2", "--port",
                 str(self.port)],
                cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + READY_S
        while "torchyard is up" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"torchyard up did not start:\n{self.log.read_text()}")
            time.sleep(0.2)

    def stop(self) -> int | None:
        """SIGTERM, as Ctrl-C would: workers hand their jobs back, then all stop."""
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"torchyard up did not stop on SIGTERM:\n{self.log.read_text()}")

    def cli(self, *argv: str, timeout: float = JOB_S) -> subprocess.CompletedProcess[str]:
        """`torchyard <argv>` as a user runs it: URL and token found through TORCHYARD_HOME."""
        return subprocess.run(
            [sys.executable, "-m", "torchyard", *argv],
            cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def client(self) -> Client:
        token = (self.home / "admin-token").read_text().strip()
        return Client(f"http://127.0.0.1:{self.port}", token)
