"""Property-based fuzz of the whole API from its own OpenAPI document (schemathesis):
no request, however odd, may get a 5xx, and every response must match the schema."""

from __future__ import annotations

from pathlib import Path

import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import HealthCheck, given, settings
from schemathesis import checks

from torchyard.api.app import create_app
from torchyard.settings import Settings
from torchyard.store.auth import create_token
from torchyard.store.db import session_scope
from torchyard.store.migrate import upgrade

TOKEN: dict[str, str] = {}
# Not positive_data_acceptance: a schema-valid spec may still be refused by what only the
# server knows (a data set not on disk, cross-field rules), by design.
CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
]


@pytest.fixture(scope="module")
def fuzz_app(tmp_path_factory: pytest.TempPathFactory) -> FastAPI:
    home: Path = tmp_path_factory.mktemp("fuzz")
    url = f"sqlite:///{home / 'fuzz.db'}"
    upgrade(url)
    with session_scope(url) as s:
        TOKEN["value"] = create_token(s, "fuzzer")
    app = create_app(
        Settings(_env_file=None, home=home, database_url=url, storage_root=home / "s")  # type: ignore[call-arg]
    )
    app.state.feed_poll_s = 0.01
    return app


# Endless streams with no parameters to fuzz (a valid call never ends): the dashboard's
# jobs stream is tested in test_api_ui.py.
ENDLESS = {("GET", "/v1/ui/jobs/changes")}


def _operations() -> list[tuple[str, str]]:
    app = create_app(Settings(_env_file=None, home="/nonexistent-torchyard"))  # type: ignore[call-arg]
    ops = [(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops]
    return [op for op in ops if op not in ENDLESS]


# schemathesis's own pytest plugin does not run under this pytest; drive its hypothesis
# strategies directly, one test per operation.
@pytest.mark.parametrize(("method", "path"), _operations(), ids=lambda v: str(v))
def test_no_server_errors(fuzz_app: FastAPI, method: str, path: str) -> None:
    schema = schemathesis.openapi.from_asgi("/openapi.json", fuzz_app)
    operation = schema[path][method]
    auth = {"Authorization": f"Bearer {TOKEN['value']}"}

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def check(case: schemathesis.Case) -> None:
        response = case.call(headers=auth)
        assert response.status_code < 500, (case.method, case.formatted_path, response.text)
        # every error the fuzz provokes has the documented shape
        if response.status_code >= 400:
            assert set(response.json()["error"]) == {"code", "message", "details"}
        # the response is documented: status code, content type and body schema
        case.validate_response(response, checks=CHECKS)

    check()
