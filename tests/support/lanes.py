"""The fast lane: `pytest -m fast` (`bash scripts/test.sh -m fast`), the inner loop's
answer in under 3 minutes. A test is in it unless it is marked as slow by kind (end to
end, chaos, browser, Slurm, deployment, GPU) or its module is on SLOW_MODULES, the
modules that took longest in a full run (`--timing-report`, tests/support/timing.py).
Every package keeps tests in the lane; the README's test command still runs everything."""

from __future__ import annotations

import pytest

SLOW_MARKERS = ("e2e", "chaos", "browser", "slurm", "deploy", "gpu")

# Over ~8 s each in a full run on this 2-core machine (seconds measured in brackets).
SLOW_MODULES = frozenset(
    {
        "tests/api/test_api_fuzz.py",  # schemathesis over the OpenAPI spec (30)
        "tests/api/test_api_asyncreads.py",  # a private PostgreSQL (15)
        "tests/api/test_api_stored_download.py",  # a SeaweedFS server (12)
        "tests/api/test_hostile_costs.py",  # live servers under attack (11)
        "tests/api/test_api_audit.py",  # both backends (10)
        "tests/api/test_api_faults.py",  # database outages (10)
        "tests/api/test_api_projects.py",  # (9)
        "tests/api/test_api_quota.py",  # both backends (9)
        "tests/api/test_api_project_quota.py",  # both backends (8)
        "tests/api/test_sso.py",  # an OIDC provider process (8)
        "tests/api/test_api_fanout.py",  # both backends, streams (8)
        "tests/api/test_api_metrics_range.py",  # both backends (6)
        "tests/chaos/test_soak_option.py",  # (8)
        "tests/client/test_client_sso.py",  # an OIDC provider process (7)
        "tests/storage/test_storage_contract.py",  # a SeaweedFS server (6)
        "tests/worker/test_sysmetrics.py",  # (5)
        "tests/client/test_hostile_demo_files.py",  # runs demo.sh with a real `up` (7)
        "tests/scheduler/test_webhook_delivery.py",  # (29)
        "tests/scheduler/test_hostile_torchvision_size.py",  # real torchvision models (10)
        "tests/store/test_schema_wait.py",  # (26)
        "tests/store/test_sweeps_store.py",  # (23)
        "tests/storage/test_storage_s3.py",  # a SeaweedFS server (11)
        "tests/storage/test_datasets.py",  # a SeaweedFS server (9)
        "tests/trainer/test_trainer_script.py",  # (33)
        "tests/trainer/test_trainer_gpu_paths.py",  # (22)
        "tests/trainer/test_trainer_lease.py",  # (11)
        "tests/worker/test_zygote.py",  # real sandboxes
        "tests/worker/test_sandbox.py",  # real sandboxes
        "tests/worker/test_hostile_tenants.py",  # real sandboxes
        "tests/worker/test_standby.py",  # warm trainers importing torch
        "tests/worker/test_hostile_events.py",  # a 1.1 GiB save (17)
        "tests/worker/test_faults.py",  # supervised trainers
    }
)


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        if module in SLOW_MODULES or any(item.get_closest_marker(m) for m in SLOW_MARKERS):
            continue
        item.add_marker(pytest.mark.fast)
