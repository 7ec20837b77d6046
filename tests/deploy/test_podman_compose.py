"""docker-compose.yml started for real: every image built here, the stack run by
podman-compose on podman with deploy/compose.cpu.yml (two CPU workers, host networking,
tests/deploy/podmanlib.py says why and how).

The stack starts on the previous release's torchyard image (podmanlib.build_previous: the
tree of TORCHYARD_UPGRADE_FROM, by default the commit before the newest migration) with a
fresh database, runs a short job, and is upgraded to the image built from this tree: the
torchyard services stopped, two `db upgrade`s started at once (the migrate service and a
`compose run`), then the new api, scheduler and workers; test_an_upgrade_keeps_every_job
checks what the upgrade kept. On the upgraded stack a world_size-2 job (one rank in each
worker container) is submitted through the API's port with the `torchyard` client, followed
to its end and its checkpoint downloaded. Then each of api, scheduler, a worker, PostgreSQL,
Redis and the object store is restarted in turn while a job runs, and that job must still
succeed. The object store's insides (SeaweedFS's filer, master and volume servers) refuse
a worker container's anonymous requests. Then scripts/backup.sh, `down -v`, scripts/restore.sh into the fresh deployment,
and the jobs' checkpoints, metrics and the admin token must all be back. Last, everything
is stopped and the containers, volumes and images the test made are removed (the cached
base image stays).

Slow (image builds: minutes) and needs root and podman: it runs only when asked for,
`bash scripts/deploy_test.sh` (which sets TORCHYARD_DEPLOY_TEST=1) or `-m deploy`; asked
for, a missing tool is a failure, never a skip. TORCHYARD_DEPLOY_KEEP_IMAGES=1 keeps the
built images for the next run (and reuses those already there).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from alembic.script import ScriptDirectory
from podmanlib import (
    PREVIOUS,
    PROJECT,
    ROOT,
    Stack,
    build_images,
    build_previous,
    image,
    podman_env,
    remove_images,
    stack_env,
)

# The first test's setup builds every image: many minutes on a small host.
pytestmark = [pytest.mark.deploy, pytest.mark.timeout(3600)]

# DDP over two worker containers: 1000 steps (half a minute here, long enough to outlast
# a restart), a resume checkpoint every 20.
SPEC: dict[str, Any] = {
    "model": {"name": "mlp", "hidden": [256]},
    "data": {"name": "synthetic", "shape": [1, 28, 28], "size": 8000, "num_classes": 10},
    "optimizer": {"name": "sgd", "lr": 0.02},
    "batch_size": 32,
    "epochs": 4,
    "world_size": 2,
    "checkpoint": {"every_steps": 20, "every_epochs": None, "keep_last": 2},
    "log_every_steps": 10,
    "seed": 3,
}
# A short job (one epoch: about ten checkpoints, of which keep_last leaves 2).
SHORT: dict[str, Any] = {"epochs": 1}
RESTARTED = ["api", "scheduler", "worker-cpu0", "postgres", "redis", "objectstore"]
HEALTH_CHECKED = {"api", "postgres", "redis", "objectstore"}
TORCHYARD_SERVICES = ["api", "scheduler", "worker-cpu0", "worker-cpu1"]
ENDED = ("succeeded", "failed", "cancelled")
TIMINGS: dict[str, Any] = {}


@dataclass
class Kept:
    """What a job has that must survive an upgrade or a restore: the sha256 of each
    checkpoint's download (`latest`, `weights`) and its metrics ({name: (steps, values)})."""

    job_id: str
    sha256: dict[str, str]
    metrics: dict[str, tuple[list[int], list[float]]]


@dataclass
class Upgrade:
    """What the fixture's upgrade saw, for test_an_upgrade_keeps_every_job."""

    ref: str
    before: Kept
    revision_before: str
    revision_after: str
    migrate_log: str  # the migrate service's container
    second_rc: int  # the `compose run migrate` started at the same time
    second_log: str


UPGRADE: list[Upgrade] = []


def _asked(config: pytest.Config) -> bool:
    if os.environ.get("TORCHYARD_DEPLOY_TEST") == "1":
        return True
    expr = str(config.getoption("markexpr") or "")
    return "deploy" in expr and "not deploy" not in expr


def _start(s: Stack) -> None:
    """In depends_on order, each step's health checks or exit status awaited."""
    s.up("objectstore-tls")
    s.wait_completed("objectstore-tls")
    _remove_one_shots(s, "objectstore-tls")
    s.up("postgres", "redis", "objectstore")
    for name in ("postgres", "redis", "objectstore"):
        s.wait_healthy(name)
    s.up("bucket", "migrate")
    s.wait_completed("bucket")
    s.wait_completed("migrate")
    _remove_one_shots(s, "bucket", "migrate")
    s.up(*TORCHYARD_SERVICES)
    s.wait_healthy("api")


def _remove_one_shots(s: Stack, *services: str) -> None:
    """Done with: vfs keeps a whole copy of the (6 GB) image for each container."""
    s.podman("rm", *[s.container(name) for name in services])


def _head() -> str:
    """The newest migration of this tree: the schema the image built from it migrates to."""
    head = ScriptDirectory(str(ROOT / "migrations")).get_current_head()
    assert head, "no migrations"
    return head


def _db_current(s: Stack) -> str:
    """`torchyard db current`, in the running api container (no new container)."""
    return s.podman("exec", s.container("api"), "torchyard", "db", "current").strip()


@pytest.fixture(scope="module")
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    if not _asked(request.config):
        pytest.skip("runs only when asked for: bash scripts/deploy_test.sh (or -m deploy)")
    env = podman_env()
    keep = os.environ.get("TORCHYARD_DEPLOY_KEEP_IMAGES") == "1"
    t0 = time.monotonic()
    s = Stack(stack_env(env))
    try:
        TIMINGS["build_s"] = build_images(env, keep)
        ref, took = build_previous(env, keep)
        TIMINGS["build_s"][PREVIOUS] = took
        t1 = time.monotonic()
        s.env["TORCHYARD_IMAGE"] = image(PREVIOUS)
        _start(s)
        TIMINGS["up_previous_s"] = round(time.monotonic() - t1, 1)
        out = s.podman("exec", s.container("api"), "torchyard", "token", "create",
                       "--local", "--user", "admin", "--admin")  # fmt: skip
        s.env["TORCHYARD_TOKEN"] = out.strip().splitlines()[-1]
        s.env["TORCHYARD_URL"] = s.api_url
        UPGRADE.append(_upgrade(s, ref, tmp_path_factory.mktemp("upgrade"), keep))
        yield s
    finally:
        t2 = time.monotonic()
        try:
            s.down()
        finally:
            if not keep:
                remove_images(env)
        TIMINGS["down_s"] = round(time.monotonic() - t2, 1)
        TIMINGS["total_s"] = round(time.monotonic() - t0, 1)
        folder = Path(os.environ.get("TORCHYARD_DEPLOY_DIR", "/var/tmp/torchyard-deploy"))
        (folder / "timings.json").write_text(json.dumps(TIMINGS))
    _assert_nothing_left(env, keep)


def _assert_nothing_left(env: dict[str, str], keep: bool) -> None:
    label = f"label=io.podman.compose.project={PROJECT}"
    for what, which in ((["ps", "-a", "-q"], label), (["volume", "ls", "-q"], label),
                        (["pod", "ls", "-q"], f"name=pod_{PROJECT}")):  # fmt: skip
        out = subprocess.run(["podman", *what, "--filter", which], env=env,
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert not out.split(), f"left after the test: podman {what[0]}: {out}"
    if not keep:
        out = subprocess.run(["podman", "images", "--format", "{{.Repository}}:{{.Tag}}"],
                             env=env, capture_output=True, text=True, check=True).stdout  # fmt: skip
        assert not [i for i in out.split() if i.endswith(":deploy-test")], out


def _client(s: Stack, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The `torchyard` client on this host, talking to the stack's API port."""
    argv = [str(Path(sys.executable).parent / "torchyard"), *args]
    return subprocess.run(argv, env=s.env, capture_output=True, text=True, timeout=timeout)


def _submit(s: Stack, tmp: Path, **overrides: Any) -> str:
    spec = tmp / "spec.json"
    spec.write_text(json.dumps(SPEC | overrides))
    p = _client(s, "submit", str(spec))
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().splitlines()[-1]


def _job(s: Stack, job_id: str) -> dict[str, Any]:
    r = httpx.get(f"{s.api_url}/v1/jobs/{job_id}", timeout=10,
                  headers={"Authorization": f"Bearer {s.env['TORCHYARD_TOKEN']}"})  # fmt: skip
    r.raise_for_status()
    return r.json()


def _metrics(s: Stack, job_id: str) -> dict[str, tuple[list[int], list[float]]]:
    """Every point of every series of the job (one page: a short job has few)."""
    r = httpx.get(f"{s.api_url}/v1/jobs/{job_id}/metrics", timeout=30,
                  headers={"Authorization": f"Bearer {s.env['TORCHYARD_TOKEN']}"})  # fmt: skip
    r.raise_for_status()
    got = r.json()
    assert got.get("next_after_step") is None, "more than one page of metrics"
    return {name: (c["steps"], c["values"]) for name, c in got["series"].items()}


def _kept(s: Stack, job_id: str, where: Path) -> Kept:
    """The job's checkpoints, downloaded with the client (sha256 each), and its metrics."""
    where.mkdir(parents=True, exist_ok=True)
    sha256 = {}
    for which in ("latest", "weights"):
        out = where / f"{job_id}-{which}"
        p = _client(s, "download", job_id, "-c", which, "-o", str(out))
        assert p.returncode == 0, f"{p.stderr[-2000:]}checkpoints: {_checkpoints(s, job_id)}"
        sha256[which] = hashlib.sha256(out.read_bytes()).hexdigest()
    metrics = _metrics(s, job_id)
    assert metrics and all(steps for steps, _ in metrics.values()), metrics
    return Kept(job_id, sha256, metrics)


def _upgrade(s: Stack, ref: str, tmp: Path, keep: bool) -> Upgrade:
    """On the previous release: a short job to success, what it left; then the torchyard
    services stopped and removed, two `db upgrade`s of the new image at once (the migrate
    service, and `compose run` as an operator might), the new services started."""
    t0 = time.monotonic()
    job_id = _submit(s, tmp, **SHORT, seed=11)
    _follow_to_success(s, job_id)
    before = _kept(s, job_id, tmp / "before")
    revision_before = _db_current(s)
    TIMINGS["previous_job_s"] = round(time.monotonic() - t0, 1)
    t1 = time.monotonic()
    s.compose("stop", "-t", "60", *TORCHYARD_SERVICES)
    _remove_one_shots(s, *TORCHYARD_SERVICES)
    if not keep:  # no container uses it now: 6 GB back before the new ones are made
        s.podman("rmi", image(PREVIOUS))
    s.env["TORCHYARD_IMAGE"] = image("torchyard")
    second = subprocess.Popen([*s.compose_argv(), "run", "--rm", "--no-deps", "-T", "migrate"],
                              env=s.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)  # fmt: skip
    s.up("migrate")
    second_log, _ = second.communicate(timeout=900)
    s.wait_completed("migrate")  # once the `run` container is gone: one migrate container
    migrate_log = s.logs("migrate", 200)
    _remove_one_shots(s, "migrate")
    s.up(*TORCHYARD_SERVICES)
    s.wait_healthy("api")
    TIMINGS["upgrade_s"] = round(time.monotonic() - t1, 1)
    return Upgrade(ref, before, revision_before, _db_current(s), migrate_log,
                   second.returncode, second_log)  # fmt: skip


def _checkpoints(s: Stack, job_id: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{s.api_url}/v1/jobs/{job_id}/checkpoints", timeout=10,
                  headers={"Authorization": f"Bearer {s.env['TORCHYARD_TOKEN']}"})  # fmt: skip
    r.raise_for_status()
    return r.json()["items"]


def _wait_checkpointed(s: Stack, job_id: str, timeout: float = 300) -> None:
    """Until the job runs and has a checkpoint: a restart now interrupts real work."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        j = _job(s, job_id)
        assert j["state"] not in ENDED, f"job {j['state']}: {j.get('error')}"
        if j["state"] == "running" and _checkpoints(s, job_id):
            return
        time.sleep(1)
    raise AssertionError(f"job {job_id} never checkpointed while running\n{s.all_logs()}")


def _follow_to_success(s: Stack, job_id: str) -> dict[str, Any]:
    """`torchyard status --follow` until the job ends; it must have succeeded."""
    p = _client(s, "status", "--follow", "--interval", "2", job_id)
    j = _job(s, job_id)
    assert j["state"] == "succeeded", (
        f"{j['state']}: {j.get('error')}\n{p.stdout[-2000:]}\n{s.all_logs()}"
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return j


def test_an_upgrade_keeps_every_job(stack: Stack, tmp_path: Path) -> None:
    """The fixture started the stack on the previous release and upgraded it."""
    (u,) = UPGRADE
    head = _head()
    assert u.revision_before != head, f"{u.ref} is already at {head}: nothing was migrated"
    assert u.revision_after == head, (u.revision_before, u.revision_after)
    # Two upgrades at once: both ended well and at head (one migrated, the other waited on
    # the migration lock, or came after and found nothing to do).
    assert u.second_rc == 0, u.second_log[-3000:]
    for log in (u.migrate_log, u.second_log):
        assert f"database at revision {head}" in log, log[-3000:]
    # `db upgrade` says each migration it ran ("Running upgrade A -> B, …"): every step
    # from the old revision to head ran, and none twice.
    steps = [line.split("Running upgrade", 1)[1].split(",")[0].strip()
             for line in (u.migrate_log + u.second_log).splitlines() if "Running upgrade" in line]  # fmt: skip
    assert steps and len(steps) == len(set(steps)), steps
    assert steps[0].startswith(f"{u.revision_before} ->") and steps[-1].endswith(head), steps
    TIMINGS["upgrade_second_waited"] = any(
        "waiting for it" in log for log in (u.migrate_log, u.second_log)
    )
    assert _job(stack, u.before.job_id)["state"] == "succeeded"
    assert _metrics(stack, u.before.job_id) == u.before.metrics
    t0 = time.monotonic()
    _follow_to_success(stack, _submit(stack, tmp_path, **SHORT, seed=12))
    TIMINGS["upgraded_job_s"] = round(time.monotonic() - t0, 1)
    # Last, as it names what is missing: the checkpoints, downloaded again.
    assert _kept(stack, u.before.job_id, tmp_path / "after") == u.before


def test_a_ddp_job_runs_and_its_checkpoint_downloads(stack: Stack, tmp_path: Path) -> None:
    t0 = time.monotonic()
    job_id = _submit(stack, tmp_path)
    j = _follow_to_success(stack, job_id)
    TIMINGS["first_job_s"] = round(time.monotonic() - t0, 1)
    ranks = {w["rank"] for a in j["attempts"] for w in a["workers"]}
    workers = {w["worker_id"] for a in j["attempts"] for w in a["workers"]}
    assert ranks == {0, 1} and len(workers) == 2, j["attempts"]
    out = tmp_path / "ckpt"
    p = _client(stack, "download", job_id, "-c", "weights", "-o", str(out))
    assert p.returncode == 0, p.stderr
    from safetensors.torch import load_file

    weights = load_file(str(out))
    assert weights and all(torch.isfinite(t).all() for t in weights.values())
    p = _client(stack, "download", job_id, "-o", str(tmp_path / "resume"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "resume").stat().st_size > 0


@pytest.mark.parametrize("service", RESTARTED)
def test_a_job_survives_a_restart_of(stack: Stack, tmp_path: Path, service: str) -> None:
    t0 = time.monotonic()
    job_id = _submit(stack, tmp_path, seed=len(service))
    _wait_checkpointed(stack, job_id)
    # A worker checkpoints its trainer on SIGTERM and hands the job back: give it time.
    stack.compose("restart", "-t", "60", service)
    if service in HEALTH_CHECKED:
        stack.wait_healthy(service)
    stack.wait_healthy("api")  # its readiness: the database and the broker answer
    state = _job(stack, job_id)["state"]
    assert state not in ENDED, f"the job was {state} before the restart was over: lengthen SPEC"
    j = _follow_to_success(stack, job_id)
    if service.startswith("worker"):
        # The stopped worker checkpointed its rank and handed the job back: a new attempt.
        assert len(j["attempts"]) >= 2, j["attempts"]
    TIMINGS[f"restart_{service}_s"] = round(time.monotonic() - t0, 1)


# Run in a worker container (where a job runs): the filer's HTTP API asked, without the S3
# gateway's JWT, to list the bucket, read an object and write one. Prints each status.
FILER_PROBE = """
import sys, urllib.error, urllib.request
filer = f"http://127.0.0.1:{sys.argv[1]}/buckets/torchyard/cluster"
for what, method, path in (("list", "GET", "/"), ("read", "GET", "/x"), ("write", "PUT", "/planted")):
    req = urllib.request.Request(filer + path, method=method, headers={"Accept": "application/json"},
                                 data=b"x" if method == "PUT" else None)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            print(what, r.status)
    except urllib.error.HTTPError as e:
        print(what, e.code)
"""


def _anonymous_grpc(port: int, method: str, body: bytes) -> str:
    """A gRPC call in the clear, without a certificate: its status code's name."""
    import grpc

    with socket.create_connection(("127.0.0.1", port), timeout=10):
        pass  # listening: a refusal below is the server's, not a closed port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            if method.endswith("/ListEntries"):
                list(channel.unary_stream(method)(body, timeout=10))
            else:
                channel.unary_unary(method)(body, timeout=10)
        except grpc.RpcError as e:
            return str(e.code().name)
    return "OK"


def test_the_object_stores_insides_refuse_anonymous_requests(stack: Stack) -> None:
    """Issue 42: a job on the compose network went around the S3 gateway's keys through
    SeaweedFS's own servers. From a worker container the filer's HTTP API refuses to list,
    read or write without the gateway's JWT; and every gRPC port (master, volume server,
    filer, and the S3 gateway's own, which sets its identities) refuses a client without
    the deployment's certificate. The gRPC calls go from this process: host networking
    here, so it reaches exactly what a worker container reaches."""
    weed = int(stack.env["TORCHYARD_DEPLOY_WEED_PORT"])
    s3 = int(stack.env["TORCHYARD_DEPLOY_S3_PORT"])
    out = stack.podman("exec", stack.container("worker-cpu0"), "python", "-c", FILER_PROBE,
                       str(weed + 2))  # fmt: skip
    assert dict(line.split() for line in out.splitlines()) == {
        "list": "401",
        "read": "401",
        "write": "401",
    }, out
    folder = b"/buckets/torchyard/cluster"
    listing = b"\x0a" + bytes([len(folder)]) + folder  # filer_pb.ListEntriesRequest{directory}
    for port, method, body in (
        (weed + 10000, "/master_pb.Seaweed/GetMasterConfiguration", b""),
        (weed + 10001, "/volume_server_pb.VolumeServer/VolumeServerStatus", b""),
        (weed + 10002, "/filer_pb.SeaweedFiler/ListEntries", listing),
        (s3 + 10000, "/messaging_pb.SeaweedS3IamCache/PutIdentity", b""),
    ):
        assert _anonymous_grpc(port, method, body) == "UNAVAILABLE", method


def _script(s: Stack, argv: list[str]) -> str:
    """One of scripts/, run as the README says, with this stack's compose command."""
    env = s.env | {"COMPOSE": " ".join(s.compose_argv())}
    p = subprocess.run(["bash", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=1200)  # fmt: skip
    assert p.returncode == 0, f"{argv} exited {p.returncode}:\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
    return p.stderr


def test_a_backup_restores_into_a_fresh_deployment(stack: Stack, tmp_path: Path) -> None:
    """scripts/backup.sh on the running stack, `down -v`, scripts/restore.sh into the empty
    one: the jobs' checkpoints and metrics are back, and so is the admin's token."""
    job_id = _submit(stack, tmp_path, **SHORT, seed=13)
    _follow_to_success(stack, job_id)
    before = _kept(stack, job_id, tmp_path / "before")
    backup = tmp_path / "backup"
    t0 = time.monotonic()
    _script(stack, ["scripts/backup.sh", str(backup)])
    TIMINGS["backup_s"] = round(time.monotonic() - t0, 1)
    assert f"schema_revision: {_head()}\n" in (backup / "MANIFEST").read_text()
    t1 = time.monotonic()
    stack.down()
    TIMINGS["down_v_s"] = round(time.monotonic() - t1, 1)
    t2 = time.monotonic()
    # All of restore.sh but its last step, `up -d`: podman 4.3 cannot start containers
    # created with podman-compose's --requires chains ("depends on container … not found
    # in input list"), so the services start as the fixture starts them (`up --no-deps`,
    # in depends_on order; postgres already runs).
    _script(stack, ["scripts/restore.sh", "--no-start", str(backup)])
    _start(stack)
    TIMINGS["restore_s"] = round(time.monotonic() - t2, 1)
    # The token of before the backup: every request below carries it.
    assert _kept(stack, job_id, tmp_path / "after") == before
    assert _job(stack, job_id)["state"] == "succeeded"
    assert _db_current(stack) == _head()
