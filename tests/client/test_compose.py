"""docker-compose.yml and the Dockerfile, checked for structure (Docker does not run here)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from torchyard.cli import COMMANDS
from torchyard.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
TORCHYARD_SERVICES = {"migrate", "api", "scheduler", "worker-gpu0", "worker-gpu1"}
# The standard AWS variables the S3 client reads (torchyard's settings do not hold keys).
AWS_VARS = {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def test_services(services: dict) -> None:
    assert (
        set(services)
        == {"postgres", "redis", "objectstore", "objectstore-tls", "bucket"} | TORCHYARD_SERVICES
    )


def test_store_and_broker_are_not_published_on_public_interfaces(services: dict) -> None:
    for name in ("postgres", "redis", "objectstore"):
        for port in services[name].get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port}"
    api_ports = services["api"]["ports"]
    assert all(re.match(r"\$\{TORCHYARD_API_BIND:-127\.0\.0\.1\}:", p) for p in api_ports)


def test_gpu_workers_are_pinned_one_gpu_each(services: dict) -> None:
    for gpu in (0, 1):
        svc = services[f"worker-gpu{gpu}"]
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        assert dev["device_ids"] == [str(gpu)]
        cmd = svc["command"]
        # Inside the container the one reserved GPU is index 0.
        assert cmd[:3] == ["worker", "--gpu", "0"]
        assert cmd[cmd.index("--name") + 1].endswith(f"-gpu{gpu}")


def test_commands_exist_in_the_cli(services: dict) -> None:
    expected = {"migrate": "db", "api": "api", "scheduler": "scheduler"}
    for name in TORCHYARD_SERVICES:
        cmd = services[name]["command"]
        assert cmd[0] in COMMANDS, f"{name}: unknown command {cmd[0]}"
        assert cmd[0] == expected.get(name, "worker")
    assert services["migrate"]["command"] == ["db", "upgrade"]
    assert services["migrate"]["restart"] == "no"


def test_environment_names_are_settings_fields(services: dict) -> None:
    fields = {f"TORCHYARD_{f.upper()}" for f in Settings.model_fields}
    for name in TORCHYARD_SERVICES:
        env = services[name]["environment"]
        names = set(env)
        assert {"TORCHYARD_DATABASE_URL", "TORCHYARD_BROKER_URL"} <= names
        assert names <= fields | AWS_VARS, f"{name}: not settings: {names - fields}"
        assert env["TORCHYARD_DATABASE_URL"].startswith("postgresql+psycopg://")
        assert env["TORCHYARD_BROKER_URL"].startswith("redis://")


def test_no_secret_is_written_in_the_file(services: dict) -> None:
    required_var = re.compile(r"\$\{[A-Z][A-Z0-9_]*:\?[^}]+\}")
    for name, svc in services.items():
        for key, value in (svc.get("environment") or {}).items():
            if "PASSWORD" in key or "SECRET" in key or "ACCESS_KEY" in key:
                # a password or key is a required variable from the environment
                assert required_var.fullmatch(str(value)), f"{name}: {key}"
            for creds in re.findall(r"://([^@/]*)@", str(value)):
                _user, _, password = creds.partition(":")
                assert required_var.fullmatch(password), f"{name}: {key} holds a password"


def test_object_storage_health_checks_and_ordering(services: dict, compose: dict) -> None:
    # Nothing shared between the torchyard containers but the database, the broker and the
    # object store: no storage volume, every file an object in the bucket.
    assert "storage" not in compose["volumes"] and "objects" in compose["volumes"]
    for name in TORCHYARD_SERVICES | {"bucket"}:
        env = services[name]["environment"]
        assert env["TORCHYARD_STORAGE_URL"] == "s3://torchyard/cluster"
        assert env["TORCHYARD_S3_ENDPOINT_URL"] == "http://objectstore:8333"
        assert not any("storage" in str(v) for v in services[name].get("volumes", []))
    for name in TORCHYARD_SERVICES - {"migrate"}:
        assert services[name]["depends_on"]["bucket"]["condition"] == (
            "service_completed_successfully"
        )
    assert services["bucket"]["depends_on"]["objectstore"]["condition"] == "service_healthy"
    for name in ("postgres", "redis", "objectstore", "api"):
        assert services[name]["healthcheck"]["test"]
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in TORCHYARD_SERVICES - {"migrate"}:
        dep = services[name]["depends_on"]["migrate"]
        assert dep["condition"] == "service_completed_successfully"


def test_dockerfile_installs_from_the_repo_with_constraints() -> None:
    text = (ROOT / "Dockerfile").read_text()
    # The base images are build arguments whose defaults are the official images.
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim$", text, re.M)
    assert re.search(r"^ARG NODE_IMAGE=node:20-slim$", text, re.M)
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}$", text, re.M)
    assert re.search(r"^FROM \$\{NODE_IMAGE\} AS web$", text, re.M)
    assert "pip install -c constraints.txt ." in text
    assert re.search(r'^ENTRYPOINT \["torchyard"\]$', text, re.M)
    assert re.search(r"^USER (?!root)\w+", text, re.M)
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".git", ".venv", ".torchyard"} <= set(ignored)


def test_every_image_name_can_be_overridden_with_the_official_one_as_default(
    services: dict, compose: dict
) -> None:
    defaults = {
        "postgres": ("TORCHYARD_POSTGRES_IMAGE", "postgres:16"),
        "redis": ("TORCHYARD_REDIS_IMAGE", "redis:7"),
        "objectstore": ("TORCHYARD_SEAWEEDFS_IMAGE", "chrislusf/seaweedfs:3.80"),
    } | {name: ("TORCHYARD_IMAGE", "torchyard:latest") for name in TORCHYARD_SERVICES}
    for name, (var, default) in defaults.items():
        assert services[name]["image"] == f"${{{var}:-{default}}}", name
    args = compose["x-torchyard"]["build"]["args"]
    assert args == {
        "PYTHON_IMAGE": "${TORCHYARD_PYTHON_IMAGE:-python:3.11-slim}",
        "NODE_IMAGE": "${TORCHYARD_NODE_IMAGE:-node:20-slim}",
    }


def test_the_object_stores_insides_answer_no_anonymous_request(services: dict) -> None:
    """SeaweedFS's filer, master and volume servers sit beside the S3 gateway, on the same
    network as the jobs: fresh JWT keys at each start (filer reads and writes, volume
    writes), admin calls from the container itself only, gRPC with mutual TLS; the same in
    the host-network override the deployment test runs (which checks them for real)."""
    store = services["objectstore"]
    assert store["depends_on"]["objectstore-tls"]["condition"] == "service_completed_successfully"
    assert "objectstore-tls:/etc/seaweedfs/tls:ro" in store["volumes"]
    env = store["environment"]
    assert env["WEED_GRPC_CA"] == "/etc/seaweedfs/tls/ca.pem"
    for part in ("MASTER", "VOLUME", "FILER", "S3", "CLIENT"):
        assert env[f"WEED_GRPC_{part}_CERT"] == "/etc/seaweedfs/tls/cert.pem"
        assert env[f"WEED_GRPC_{part}_KEY"] == "/etc/seaweedfs/tls/key.pem"
    loader = type("Loader", (yaml.SafeLoader,), {})
    loader.add_constructor("!reset", lambda _loader, _node: None)  # compose's override tag
    text = (ROOT / "deploy" / "compose.cpu.yml").read_text()
    override = yaml.load(text, Loader=loader)["services"]  # a SafeLoader
    for command in (store["command"][0], override["objectstore"]["command"][0]):
        for key in ("SIGNING_KEY", "FILER_SIGNING_KEY", "FILER_SIGNING_READ_KEY"):
            assert f"WEED_JWT_{key}" in command
        assert "-whiteList=127.0.0.1,@" in command and "-ip=127.0.0.1" in command
    tls = services["objectstore-tls"]
    assert tls["restart"] == "no" and tls["volumes"] == ["objectstore-tls:/tls"]
