"""docker-compose.yml run by podman-compose on podman, for the deployment test.

Podman reads this test's own configuration (CONTAINERS_CONF / CONTAINERS_STORAGE_CONF under
TORCHYARD_DEPLOY_DIR, written by scripts/deploy_test.sh): runc, cgroupfs, vfs storage, host
networking, ulimits within this host's hard limits. Every image is built here from the
local Debian base (deploy/images/ and the Dockerfile with its base images as build
arguments), since no image registry is reachable.

Debian bookworm's podman (4.3) runs no health check by itself without systemd, and has no
`podman wait --condition=healthy` (podman-compose skips `service_healthy` conditions on
it): `wait_healthy` runs each service's own compose health check (`podman healthcheck
run`), and the test starts the services in the order their `depends_on` gives.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT = "torchyard-deploy-test"
TAG = "deploy-test"
COMPOSE_FILES = [ROOT / "docker-compose.yml", ROOT / "deploy" / "compose.cpu.yml"]
IMAGES = ROOT / "deploy" / "images"
# (image, Containerfile or None for the repository's Dockerfile), in build order: the
# torchyard image's dashboard stage needs the Node image.
BUILDS = [
    ("torchyard-node", IMAGES / "node.Containerfile"),
    ("torchyard", None),
    ("torchyard-postgres", IMAGES / "postgres.Containerfile"),
    ("torchyard-redis", IMAGES / "redis.Containerfile"),
    ("torchyard-seaweedfs", IMAGES / "seaweedfs.Containerfile"),
]
# The previous release's torchyard image, for the upgrade test.
PREVIOUS = "torchyard-previous"
SOURCE_LABEL = "torchyard.source"


def image(name: str) -> str:
    return f"localhost/{name}:{TAG}"


def deploy_dir() -> Path:
    return Path(os.environ.get("TORCHYARD_DEPLOY_DIR", "/var/tmp/torchyard-deploy"))


def podman_env() -> dict[str, str]:
    """The environment podman needs here: its configuration from the deploy folder."""
    folder = deploy_dir()
    conf, storage = folder / "containers.conf", folder / "storage.conf"
    if not (conf.is_file() and storage.is_file()):
        raise AssertionError(
            f"no podman configuration in {folder}: run bash scripts/deploy_test.sh"
        )
    return os.environ | {"CONTAINERS_CONF": str(conf), "CONTAINERS_STORAGE_CONF": str(storage)}


def run(argv: list[str], env: dict[str, str], timeout: float = 300) -> str:
    """Run a command; its output, or an AssertionError with that output."""
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(
            f"{argv[:6]} exited {p.returncode}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
        )
    return p.stdout


def _base() -> str:
    return os.environ.get("TORCHYARD_DEPLOY_BASE", "localhost/torchyard-base:bookworm")


def _build_argv(name: str) -> list[str]:
    """`--layers=false`: one layer per image, as vfs copies every layer whole."""
    return ["podman", "build", "--layers=false", "--network=host", "-t", image(name)]


def _torchyard_build_args() -> list[str]:
    return ["--build-arg", f"PYTHON_IMAGE={_base()}",
            "--build-arg", f"NODE_IMAGE={image('torchyard-node')}"]  # fmt: skip


def build_images(env: dict[str, str], keep: bool) -> dict[str, float]:
    """Build every image (seconds each). `keep`: an image already there is reused."""
    base = _base()
    took: dict[str, float] = {}
    for name, containerfile in BUILDS:
        exists = subprocess.run(["podman", "image", "exists", image(name)], env=env).returncode == 0
        if keep and exists:
            continue
        argv = _build_argv(name)
        if containerfile is None:
            argv += [*_torchyard_build_args(), str(ROOT)]
        else:
            argv += ["--build-arg", f"BASE={base}", "-f", str(containerfile), str(IMAGES)]
        t0 = time.monotonic()
        run(argv, env, timeout=3600)
        took[name] = round(time.monotonic() - t0, 1)
    return took


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip


def previous_ref() -> str:
    """The commit the upgrade starts from: TORCHYARD_UPGRADE_FROM (any git ref), else the
    parent of the commit that added the newest migration, so that the upgrade runs at least
    one real migration. (A newest migration not committed yet: HEAD is the release before.)"""
    ref = os.environ.get("TORCHYARD_UPGRADE_FROM")
    if not ref:
        newest = sorted((ROOT / "migrations" / "versions").glob("[0-9]*.py"))[-1]
        rel = newest.relative_to(ROOT).as_posix()
        added = _git("log", "--diff-filter=A", "--format=%H", "-1", "--", rel)
        ref = f"{added}^" if added else "HEAD"
    return _git("rev-parse", "--verify", f"{ref}^{{commit}}")


def build_previous(env: dict[str, str], keep: bool) -> tuple[str, float | None]:
    """The previous release's torchyard image, `image(PREVIOUS)`, built from the tree of
    `previous_ref()`: its commit and the seconds the build took (None: `keep` and an image
    of that commit is there). That tree gets the *current* Dockerfile and .dockerignore:
    older Dockerfiles lack the base-image build arguments (PYTHON_IMAGE, NODE_IMAGE) a host
    without a registry needs. Its own code, pyproject.toml and constraints are what go in."""
    ref = previous_ref()
    got = subprocess.run(["podman", "image", "inspect", "--format",
                          f'{{{{index .Labels "{SOURCE_LABEL}"}}}}', image(PREVIOUS)],
                         env=env, capture_output=True, text=True)  # fmt: skip
    if keep and got.returncode == 0 and got.stdout.strip() == ref:
        return ref, None
    src = deploy_dir() / "previous-src"
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    t0 = time.monotonic()
    try:
        archive = subprocess.Popen(["git", "-C", str(ROOT), "archive", ref], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(src)], stdin=archive.stdout, check=True)
        assert archive.wait() == 0, f"git archive {ref} failed"
        for f in ("Dockerfile", ".dockerignore"):
            shutil.copy(ROOT / f, src / f)
        argv = [*_build_argv(PREVIOUS), *_torchyard_build_args(),
                "--label", f"{SOURCE_LABEL}={ref}", str(src)]  # fmt: skip
        run(argv, env, timeout=3600)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    return ref, round(time.monotonic() - t0, 1)


def _free_port(avoid: set[int], plus: tuple[int, ...] = (0,)) -> int:
    """A port p with p + k free on 127.0.0.1 for every k in `plus`, none in `avoid`."""
    rng = secrets.SystemRandom()
    while True:
        p = rng.randrange(20000, 40000)
        wanted = {p + k for k in plus}
        if wanted & avoid:
            continue
        if all(_bindable(q) for q in wanted):
            avoid |= wanted
            return p


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def stack_env(env: dict[str, str]) -> dict[str, str]:
    """The compose variables: fresh secrets, the local images, free ports (SeaweedFS's
    master, volume server and filer on three consecutive ports, each with its gRPC port at
    +10000)."""
    taken: set[int] = set()
    return env | {
        "POSTGRES_PASSWORD": secrets.token_hex(16),
        "REDIS_PASSWORD": secrets.token_hex(16),
        "S3_ACCESS_KEY": "torchyard",
        "S3_SECRET_KEY": secrets.token_hex(16),
        "TORCHYARD_IMAGE": image("torchyard"),
        "TORCHYARD_POSTGRES_IMAGE": image("torchyard-postgres"),
        "TORCHYARD_REDIS_IMAGE": image("torchyard-redis"),
        "TORCHYARD_SEAWEEDFS_IMAGE": image("torchyard-seaweedfs"),
        "TORCHYARD_API_PORT": str(_free_port(taken)),
        "TORCHYARD_DEPLOY_PG_PORT": str(_free_port(taken)),
        "TORCHYARD_DEPLOY_REDIS_PORT": str(_free_port(taken)),
        "TORCHYARD_DEPLOY_S3_PORT": str(_free_port(taken, (0, 10000))),
        "TORCHYARD_DEPLOY_WEED_PORT": str(_free_port(taken, (0, 1, 2, 10000, 10001, 10002))),
    }


@dataclass
class Stack:
    """The compose project: how to drive it and what it is called."""

    env: dict[str, str]
    started: list[str] = field(default_factory=list)

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.env['TORCHYARD_API_PORT']}"

    @staticmethod
    def compose_argv() -> list[str]:
        """podman-compose with this project's name and files: scripts/backup.sh and
        scripts/restore.sh get it as COMPOSE."""
        tool = Path(sys.executable).parent / "podman-compose"
        files = [a for f in COMPOSE_FILES for a in ("-f", str(f))]
        return [str(tool), "-p", PROJECT, *files]

    def compose(self, *args: str, timeout: float = 600) -> str:
        return run([*self.compose_argv(), *args], self.env, timeout)

    def podman(self, *args: str, timeout: float = 300) -> str:
        return run(["podman", *args], self.env, timeout)

    def container(self, service: str) -> str:
        out = self.podman("ps", "-a", "--format", "{{.Names}}",
                          "--filter", f"label=io.podman.compose.project={PROJECT}",
                          "--filter", f"label=io.podman.compose.service={service}")  # fmt: skip
        names = out.split()
        assert len(names) == 1, f"{service}: containers {names}"
        return names[0]

    def up(self, *services: str) -> None:
        """Create and start these services only (their dependencies were started before)."""
        self.compose("up", "-d", "--no-build", "--no-deps", *services)
        self.started += [s for s in services if s not in self.started]

    def healthy(self, service: str) -> bool:
        """The service's own compose health check, run now."""
        p = subprocess.run(["podman", "healthcheck", "run", self.container(service)],
                           env=self.env, capture_output=True, timeout=60)  # fmt: skip
        return p.returncode == 0

    def wait_healthy(self, service: str, timeout: float = 180) -> float:
        """Until the health check passes: the seconds it took."""
        t0 = time.monotonic()
        while not self.healthy(service):
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"{service} never healthy:\n{self.logs(service)}")
            time.sleep(1)
        return time.monotonic() - t0

    def wait_completed(self, service: str, timeout: float = 300) -> None:
        """A one-shot service ran to its end with status 0."""
        name = self.container(service)
        self.podman("wait", name, timeout=timeout)
        code = self.podman("inspect", "--format", "{{.State.ExitCode}}", name).strip()
        assert code == "0", f"{service} exited {code}:\n{self.logs(service)}"

    def logs(self, service: str, lines: int = 60) -> str:
        p = subprocess.run(["podman", "logs", "--tail", str(lines), self.container(service)],
                           env=self.env, capture_output=True, text=True, timeout=60)  # fmt: skip
        return p.stdout + p.stderr

    def all_logs(self) -> str:
        """The tail of every container's log still there (for a failure's message)."""
        out = []
        for name in self.started:
            try:
                out.append(f"--- {name} ---\n{self.logs(name, 30)}")
            except AssertionError:
                continue  # a one-shot, removed once done
        return "\n".join(out)

    def down(self) -> None:
        """Stop and remove the containers, their pod and volumes."""
        self.compose("down", "-v", "-t", "30")
        left = self.podman(
            "volume", "ls", "-q", "--filter", f"label=io.podman.compose.project={PROJECT}"
        )
        if left.split():
            self.podman("volume", "rm", "-f", *left.split())


def remove_images(env: dict[str, str]) -> None:
    """Remove every image the test built (the cached base stays)."""
    for name in [PREVIOUS, *(n for n, _ in reversed(BUILDS))]:
        subprocess.run(["podman", "rmi", "-f", image(name)], env=env, capture_output=True)
    subprocess.run(["podman", "image", "prune", "-f"], env=env, capture_output=True)
