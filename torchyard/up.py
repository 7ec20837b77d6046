"""`torchyard up [--workers N] [--port P] [--metrics-port BASE]`: the whole service on one
machine, in one command.

It applies the migrations, makes an admin token the first time (kept in
`$TORCHYARD_HOME/admin-token`, mode 0600), then runs the API, the scheduler and one
worker per GPU (or N CPU worker slots when there is none), each as its own child
process, exactly the processes a deployment runs. A child that dies is reported and
restarted (with back-off); Ctrl-C or SIGTERM stops the workers first (each hands its
running job back with a checkpoint), then the scheduler and the API.

Everything lives under TORCHYARD_HOME, so running it again picks up where it stopped.
This module may use `store` but never imports the API or the worker: it spawns them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from torchyard.contracts.parent import die_with_parent
from torchyard.contracts.plurals import plural
from torchyard.settings import private_umask

READY_TIMEOUT_S = 90.0
# A worker gets this long after SIGTERM to checkpoint its trainer and hand the job back.
WORKER_STOP_GRACE_S = 45.0
OTHERS_STOP_GRACE_S = 10.0
# How long the workers' SIGTERM waits for the scheduler to stop assigning work.
SCHEDULER_STOP_WAIT_S = 2.0
MAX_BACKOFF_S = 30.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="torchyard up", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="CPU worker slots when there is no GPU (default 2); with GPUs, at most this many",
    )
    p.add_argument("--port", type=int, default=8000, help="API port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="API address (default 127.0.0.1)")
    p.add_argument("--cpu", action="store_true", help="CPU workers even when GPUs are present")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="BASE",
        help="Prometheus metrics of the scheduler on BASE and of worker i on BASE+1+i, at "
        "TORCHYARD_METRICS_ADDR (default: TORCHYARD_METRICS_PORT; off when neither is set)",
    )
    p.add_argument(
        "--storage-url",
        default=None,
        help="where checkpoints, logs and bundles live: s3://bucket/prefix for an object "
        "store (with TORCHYARD_S3_ENDPOINT_URL and AWS_* credentials); default: the local "
        "storage root (TORCHYARD_STORAGE_URL)",
    )
    args = p.parse_args(argv)
    if args.storage_url:
        os.environ["TORCHYARD_STORAGE_URL"] = args.storage_url  # this process and its children
    if args.workers is not None and args.workers < 0:
        p.error("--workers must be >= 0")
    if args.metrics_port is not None and not 1 <= args.metrics_port <= 65535:
        p.error("--metrics-port must be 1 to 65535")
    private_umask()  # the home, the database, logs and run files: this user's alone
    try:
        return Up(args).run()
    except UpError as e:
        print(f"torchyard up: {e}", file=sys.stderr)
        return 1


class UpError(Exception):
    """A problem that stops `up` before it serves, said in one line."""


def detect_gpus(env: dict[str, str] | None = None, smi: str | None = None) -> list[int]:
    """Physical GPU indices, without importing torch or touching CUDA in this process:
    `nvidia-smi -L`, narrowed to CUDA_VISIBLE_DEVICES (indices or UUIDs) when it is set.
    `smi` is nvidia-smi's output, for tests."""
    env = dict(os.environ) if env is None else env
    if smi is None:
        exe = shutil.which("nvidia-smi")
        try:
            smi = (
                subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=10).stdout
                if exe
                else ""
            )
        except (OSError, subprocess.SubprocessError):
            smi = ""
    # "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5c3f…)"
    found: dict[int, str] = {}
    for line in smi.splitlines():
        if line.startswith("GPU ") and ":" in line:
            idx = line[4:].split(":", 1)[0]
            if idx.isdigit():
                uuid = line.rsplit("UUID:", 1)[1].strip(" )") if "UUID:" in line else ""
                found[int(idx)] = uuid
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return sorted(found)
    items = [v.strip() for v in visible.split(",") if v.strip()]
    gpus: list[int] = []
    for v in items:
        if v == "-1":  # CUDA stops at the first invalid entry
            break
        if v.isdigit():
            if int(v) in found:
                gpus.append(int(v))
        else:
            gpus += [i for i, u in found.items() if u and u.startswith(v)]
    return gpus


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None
    started_at: float = 0.0
    restarts: int = 0
    next_start: float = 0.0
    quick_deaths: int = 0
    extra_env: dict[str, str] = field(default_factory=dict)


def _die_with_parent(parent_pid: int) -> Any:
    """Runs in the child before exec: if `up` is killed outright, its children get SIGTERM
    (and shut down cleanly) instead of living on as orphans."""

    def preexec() -> None:
        die_with_parent(signal.SIGTERM)
        if os.getppid() != parent_pid:  # `up` died before the prctl took effect
            os._exit(0)

    return preexec


class Up:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.stopping = False
        self.children: list[Child] = []

    # -- set-up ---------------------------------------------------------------------------------

    def run(self) -> int:
        from torchyard.settings import Settings

        try:
            settings = Settings()
        except Exception as e:  # pydantic's message names the TORCHYARD_* variable to fix
            raise UpError(f"invalid settings: {e}") from None
        home = settings.home.resolve()
        home.mkdir(parents=True, exist_ok=True)
        make_private(home)
        lock = self._lock(home)
        try:
            return self._serve(settings, home)
        finally:
            lock.close()

    def _lock(self, home: Path) -> IO[str]:
        from torchyard.store.paths import try_lock

        f = try_lock(home / "up.lock")
        if f is None:
            raise UpError(
                f"another `torchyard up` is already running on {home} (stop it, or set "
                "TORCHYARD_HOME to another directory)"
            )
        return f

    def _serve(self, settings: Any, home: Path) -> int:
        host, port = self.args.host, self.args.port
        if not _port_free(host, port):
            raise UpError(f"port {port} on {host} is in use; pick another with --port")
        say(f"home     {home}")
        say(f"database {_redact(settings.db_url)}")
        from torchyard.storage import storage_for, storage_url
        from torchyard.storage.base import StorageConfigError

        say(f"storage  {_redact(storage_url(settings))}")
        try:
            storage_for(settings).check()
        except (StorageConfigError, ValueError) as e:
            raise UpError(f"storage: {e}") from None
        from torchyard.store.migrate import upgrade

        try:
            upgrade(settings.db_url)
            token = ensure_admin_token(settings, home)
        except Exception as e:  # a database that cannot be reached or migrated: one line
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise UpError(f"database {_redact(settings.db_url)}: {first}") from None
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"

        self._plan(home, host, port)
        base = self.args.metrics_port
        self._metrics_ports(settings.metrics_port if base is None else base, settings.metrics_addr)
        signal.signal(signal.SIGINT, self._on_signal)
        signal.signal(signal.SIGTERM, self._on_signal)
        # Where this home's API listens, for the CLI (kept after stopping: clients that
        # follow a job across a restart find it again).
        (home / "url").write_text(url + "\n")
        save_login(url, token)
        for c in self.children:
            self._start(c)
        try:
            if not self._wait_ready(url):
                return 1
            say("")
            say(f"torchyard is up: {url}")
            say(f"admin token (also in {home / 'admin-token'}):")
            say(f"  {token}")
            say(f"logs in {home / 'logs'}; Ctrl-C stops everything")
            say("try:  torchyard submit examples/digits.json --follow")
            self._supervise()
            return 0
        finally:
            self._stop_all()

    def _plan(self, home: Path, host: str, port: int) -> None:
        logs = home / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        me = [sys.executable, "-m", "torchyard"]
        self.children = [
            Child("api", [*me, "api", "--host", host, "--port", str(port)], logs / "api.log"),
            Child("scheduler", [*me, "scheduler"], logs / "scheduler.log"),
        ]
        gpus = [] if self.args.cpu else detect_gpus()
        host_id = _slug(socket.gethostname())
        if gpus:
            if self.args.workers is not None:
                gpus = gpus[: self.args.workers]
            for g in gpus:
                # The worker pins its trainer with CUDA_VISIBLE_DEVICES=<g> itself, so the
                # worker must see physical indices: drop any narrowing inherited from here.
                c = Child(
                    f"worker-gpu{g}",
                    [*me, "worker", "--gpu", str(g), "--name", f"{host_id}-gpu{g}"],
                    logs / f"worker-gpu{g}.log",
                )
                c.extra_env = {"CUDA_VISIBLE_DEVICES": ""}
                self.children.append(c)
            say(f"workers  {plural(len(gpus), 'GPU worker')}: {', '.join(map(str, gpus))}")
        else:
            n = 2 if self.args.workers is None else self.args.workers
            # CPU trainers share this host's cores: oversubscribed threads train many times
            # slower. A fixed count (not one derived from load) keeps CPU resume bitwise exact.
            threads = os.environ.get("TORCHYARD_TRAINER_THREADS") or str(
                max(1, (os.cpu_count() or 1) // max(1, n))
            )
            for i in range(n):
                c = Child(
                    f"worker-cpu{i}",
                    [*me, "worker", "--device", "cpu", "--name", f"{host_id}-cpu{i}"],
                    logs / f"worker-cpu{i}.log",
                )
                c.extra_env = {"TORCHYARD_TRAINER_THREADS": threads}
                self.children.append(c)
            say(f"workers  {plural(n, 'CPU worker slot')}")
        self.env = dict(os.environ)
        # Children must agree with this process on every path, whatever their cwd.
        self.env["TORCHYARD_HOME"] = str(home)
        self.env.setdefault("PYTHONUNBUFFERED", "1")

    def _metrics_ports(self, base: int | None, addr: str) -> None:
        """With a base port: the scheduler serves its metrics on it, worker i on base + 1 + i
        (each child's own `--metrics-port`, kept across its restarts)."""
        if base is None:
            return
        served = [c for c in self.children if c.name != "api"]  # the scheduler first
        if base + len(served) - 1 > 65535:
            raise UpError(f"metrics ports {base} to {base + len(served) - 1}: past 65535")
        for i, c in enumerate(served):
            if ":" not in addr and not _port_free(addr, base + i):
                raise UpError(
                    f"metrics port {base + i} on {addr} ({c.name}) is in use; pick another "
                    "base with --metrics-port"
                )
            c.argv += ["--metrics-port", str(base + i)]
        workers = [str(base + 1)] if len(served) == 2 else []
        if len(served) > 2:
            workers = [f"{base + 1}-{base + len(served) - 1}"]
        say(
            f"metrics  http://{addr}:PORT/metrics: scheduler {', workers '.join([str(base), *workers])}"
        )

    # -- children -------------------------------------------------------------------------------

    def _start(self, c: Child) -> None:
        env = dict(self.env)
        for k, v in c.extra_env.items():
            if v:
                env[k] = v
            else:
                env.pop(k, None)
        if c.log is None:
            c.log = c.log_path.open("ab")
        c.log.write(
            f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} torchyard up starts "
            f"{c.name}: {' '.join(c.argv[1:])}\n".encode()
        )
        c.log.flush()
        c.proc = subprocess.Popen(
            c.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=c.log,
            stderr=subprocess.STDOUT,
            # Own process group: a terminal's Ctrl-C reaches `up` alone, and `up` decides
            # the order in which its children stop.
            process_group=0,
            preexec_fn=_die_with_parent(os.getpid()),
        )
        c.started_at = time.monotonic()

    def _wait_ready(self, url: str) -> bool:
        api = self.children[0]
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.stopping:
            if api.proc is not None and api.proc.poll() is not None:
                say(f"the API exited with code {api.proc.returncode} before it was ready:")
                say(_tail(api.log_path))
                return False
            if _http_ok(url + "/readyz"):
                return True
            if time.monotonic() > deadline:
                say(f"the API was not ready after {READY_TIMEOUT_S:.0f}s; see {api.log_path}:")
                say(_tail(api.log_path))
                return False
            time.sleep(0.2)
        return False

    def _supervise(self) -> None:
        while not self.stopping:
            now = time.monotonic()
            for c in self.children:
                if c.proc is None:
                    if now >= c.next_start and not self.stopping:
                        say(f"restarting {c.name} (restart {c.restarts})")
                        self._start(c)
                    continue
                rc = c.proc.poll()
                if rc is None:
                    if now - c.started_at > 60:
                        c.quick_deaths = 0
                    continue
                lived = now - c.started_at
                c.quick_deaths = c.quick_deaths + 1 if lived < 10 else 0
                c.restarts += 1
                delay = min(MAX_BACKOFF_S, 2.0 ** min(c.quick_deaths, 5))
                say(
                    f"{c.name} exited with code {rc} after {lived:.0f}s; "
                    f"restarting in {delay:.0f}s. Last lines of {c.log_path}:"
                )
                say(_tail(c.log_path, 5))
                c.proc, c.next_start = None, now + delay
            time.sleep(0.25)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if self.stopping:  # a second Ctrl-C: stop waiting for graceful shutdown
            say("stopping now")
            for c in self.children:
                _kill(c, signal.SIGKILL)
            return
        self.stopping = True
        say(
            f"\n{signal.Signals(signum).name}: stopping (workers hand their jobs back first; "
            "Ctrl-C again to kill)"
        )

    def _stop_all(self) -> None:
        self.stopping = True
        by_role: dict[str, list[Child]] = {"scheduler": [], "worker": [], "api": []}
        for c in self.children:
            by_role[c.name.split("-")[0]].append(c)
        # The scheduler first, so that nothing is assigned to a stopping worker; then the
        # workers, each checkpointing its trainer and re-queueing the job; the API last, so
        # clients see the job go back to the queue.
        for role, grace in (
            ("scheduler", SCHEDULER_STOP_WAIT_S),
            ("worker", WORKER_STOP_GRACE_S),
            ("api", OTHERS_STOP_GRACE_S),
        ):
            # A scheduler still stopping is not killed yet: the workers must not wait.
            _stop_group(by_role[role], grace, kill_late=role != "scheduler")
        for c in by_role["scheduler"]:
            if c.proc is not None and c.proc.poll() is None:
                try:
                    c.proc.wait(timeout=OTHERS_STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    say(f"{c.name} did not stop; killing it")
                    _kill(c, signal.SIGKILL)
        for c in self.children:
            if c.log is not None:
                c.log.close()
                c.log = None
        say("stopped")


def ensure_admin_token(settings: Any, home: Path) -> str:
    """The admin token in `home/admin-token`, created (mode 0600) when missing or no longer
    known to the database (e.g. the database was reset)."""
    from torchyard.store.auth import create_token, user_for_token
    from torchyard.store.db import session_scope

    path = home / "admin-token"
    if path.exists():
        _tighten(path, 0o600)
        token = path.read_text().strip()
        with session_scope(settings.db_url) as s:
            if token and user_for_token(s, token) is not None:
                return token
        say(f"{path} holds a token the database does not know; making a new one")
        path.unlink()
    with session_scope(settings.db_url) as s:
        token = create_token(s, "admin", admin=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    say(f"created an admin token in {path}")
    return token


def make_private(home: Path) -> None:
    """The home holds the admin token, the database and the logs (and `scripts/demo.sh`'s
    up.log, which shows the token): this user's alone. One that others may read (made by an
    older `up` or `demo.sh`, or by hand) is made 0700, and said; a folder that is not this
    user's own, or is shared (sticky, like /tmp), is left as it is, with a warning."""
    st = home.stat()
    if not st.st_mode & 0o077:
        return
    if st.st_uid != os.geteuid() or st.st_mode & stat.S_ISVTX:
        say(f"warning: {home} is open to others ({oct(st.st_mode & 0o777)}) and not yours")
        say("alone to close: set TORCHYARD_HOME to a folder of your own")
        return
    _tighten(home, 0o700)


def _tighten(path: Path, mode: int) -> None:
    """`path` given `mode` when others could read it (a symlink is left alone)."""
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not st.st_mode & 0o077:
        return
    os.chmod(path, mode)
    say(f"made {path} yours alone ({oct(mode)}; it was {oct(st.st_mode & 0o777)})")


def save_login(url: str, token: str, env: dict[str, str] | None = None) -> None:
    """Save this server's URL and admin token in the per-user login file, so the CLI finds it
    from any directory. A login to another server (`torchyard login`) is kept: it is the
    user's choice, and its token may be had nowhere else. `up` says so, and how to switch."""
    from torchyard.client import config
    from torchyard.client.errors import ConfigError

    path = config.config_path(env)
    try:
        saved = config.load(env)
    except ConfigError as e:  # unusable as it is: replaced, and said
        say(f"{e}; replacing it")
        saved = None
    if saved is not None and saved.saved_by == "login":
        if saved.url != config.normal_url(url):
            say(f"kept your login to {saved.url} in {path}: clients use it before this home's")
            say(f"files; to use this server from anywhere: torchyard login {url} --token <the")
            say("admin token below>, or set TORCHYARD_URL and TORCHYARD_TOKEN")
        return  # a login to this very server, maybe as another user: left as it is
    try:
        config.save(url, token, saved_by="up", env=env)
    except OSError as e:
        say(f"could not save the login file {path} ({e.strerror or e}); clients find this")
        say(f"server from this directory only, or with TORCHYARD_URL={url}")
        return
    if saved is None or saved.url != config.normal_url(url):
        say(f"saved {url} and the admin token in {path}: the CLI finds them from any directory")


def _kill(c: Child, sig: int) -> None:
    if c.proc is None or c.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        c.proc.send_signal(sig)


def _stop_group(group: list[Child], grace: float, *, kill_late: bool) -> None:
    """SIGTERM every child of `group`, wait up to `grace` seconds for them together, then
    (with `kill_late`) SIGKILL those still running."""
    for c in group:
        _kill(c, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in group:
        if c.proc is None:
            continue
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            if not kill_late:
                continue
            say(f"{c.name} did not stop in {grace:.0f}s; killing it")
            _kill(c, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=5)


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return "  (no log)"
    return "\n".join("  | " + line for line in lines)


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name)[:60] or "host"


def _redact(url: str) -> str:
    """A database URL without its password."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, hostpart = rest.rsplit("@", 1)
        return f"{scheme}://{creds.split(':', 1)[0]}:***@{hostpart}"
    return url


def say(msg: str) -> None:
    print(msg, flush=True)


if __name__ == "__main__":
    sys.exit(main())
