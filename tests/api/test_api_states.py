"""GET /v1/states serves the contracts' state lists; the responses' `state` fields are typed
with the enums in OpenAPI and still serialise as plain names."""

from __future__ import annotations

from fastapi.testclient import TestClient
from support.db import Factory

from torchyard.api.schemas import AttemptOut, JobSummary, WorkerOut
from torchyard.contracts.states import AttemptState, JobState, WorkerState, state_lists


def test_states_route_serves_the_contracts_lists(client: TestClient, alice: dict[str, str]) -> None:
    r = client.get("/v1/states", headers=alice)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == state_lists()
    assert body["job"]["states"] == [s.value for s in JobState]
    assert set(body["job"]["terminal"]) == {"succeeded", "failed", "cancelled"}
    assert client.get("/v1/states").status_code == 401


def test_openapi_lists_the_state_enums(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    for model, enum in (("JobSummary", JobState), ("AttemptOut", AttemptState), ("WorkerOut", WorkerState)):  # fmt: skip
        ref = schemas[model]["properties"]["state"]["$ref"]
        assert ref == f"#/components/schemas/{enum.__name__}"
        assert schemas[enum.__name__]["enum"] == [s.value for s in enum]


def test_no_two_response_models_share_a_name(client: TestClient) -> None:
    """Two models of one name get module-qualified schema names (`torchyard__api__…`),
    which clients generated from the OpenAPI document then see."""
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert [k for k in schemas if "__" in k] == []


def test_states_serialise_as_plain_strings(
    client: TestClient, factory: Factory, alice: dict[str, str]
) -> None:
    job_id = factory.job("alice", state="running")
    factory.attempt(job_id, state="running")  # with one busy worker
    job = client.get(f"/v1/jobs/{job_id}", headers=alice).json()
    assert job["state"] == "running"
    assert [a["state"] for a in job["attempts"]] == ["running"]
    listed = client.get("/v1/jobs", headers=alice).json()["items"]
    assert [j["state"] for j in listed] == ["running"]
    workers = client.get("/v1/workers", headers=alice).json()["items"]
    assert [w["state"] for w in workers] == ["busy"]
    # in Python too: a validated state is the plain name, not the enum member
    summary = JobSummary.model_validate({**listed[0]})
    worker = WorkerOut.model_validate(workers[0])
    attempt = AttemptOut.model_validate(job["attempts"][0])
    for value in (summary.state, worker.state, attempt.state, summary.model_dump()["state"]):
        assert type(value) is str
