"""Liveness, readiness (503 with the database down), Prometheus metrics, OpenAPI."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from torchyard.api.app import create_app
from torchyard.settings import Settings


def test_healthz_and_readyz(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    r = client.get("/readyz")
    assert r.status_code == 200, r.text
    assert r.json() == {"status": "ok", "database": True, "broker": True}


def test_readyz_is_503_while_the_database_is_unreachable(tmp_path: Path) -> None:
    # port 9 (discard) on loopback: connection refused at once
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        home=tmp_path,
        database_url="postgresql+psycopg://postgres@127.0.0.1:9/none",
    )
    with TestClient(create_app(settings)) as c:
        r = c.get("/readyz")
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == "unavailable" and "database" in err["message"]
        assert err["details"] == {"database": False, "broker": True}
        assert c.get("/healthz").status_code == 200
        # routes that need the store answer 503 too, in the error shape
        r = c.get("/v1/jobs", headers={"Authorization": "Bearer ty_x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"


def test_prometheus_metrics(
    client: TestClient, alice: dict[str, str], admin: dict[str, str]
) -> None:
    client.get("/v1/jobs", headers=alice)
    client.post("/v1/jobs", json={"model": {"name": "mlp"}}, headers=alice)
    assert client.get("/metrics", headers=alice).status_code == 403  # pool-wide: admins
    r = client.get("/metrics", headers=admin)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'torchyard_http_requests_total{method="GET",route="/v1/jobs",status="200"} 1.0' in text
    assert 'route="/v1/jobs",status="422"' in text
    assert "torchyard_http_request_duration_seconds_bucket" in text
    assert "# TYPE torchyard_jobs gauge" in text


def test_openapi_documents_bodies_and_errors(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert {"JobOut", "JobList", "MetricsOut", "LogChunk", "CheckpointList", "WorkerList"} <= set(
        schemas
    )
    assert {"JobSpec", "ModelSpec", "DataSpec", "ErrorBody"} <= set(schemas)
    submit = doc["paths"]["/v1/jobs"]["post"]
    assert submit["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/JobSpec"
    )
    assert {"201", "200", "401", "409", "413", "422"} <= set(submit["responses"])
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            # single sign-on's steps are public (tests/api/test_api_access.py: SSO_STEPS)
            if path not in ("/healthz", "/readyz") and not path.startswith(("/v1/ui/sso", "/v1/auth/")):  # fmt: skip
                assert "401" in op["responses"], (method, path)
            if "{job_id}" in path:
                assert "404" in op["responses"], (method, path)
    assert "HTTPBearer" in doc["components"]["securitySchemes"]
