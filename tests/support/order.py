"""The order modules start in when the suite runs in several processes (pytest-xdist,
`TORCHYARD_TEST_PROCESSES=N bash scripts/test.sh`, `--dist loadfile`: a module stays in
one process, so its module-scoped cluster starts once): the longest first. A process picks
the next module when it is free; a long module picked last would run alone at the end
while the other processes sit idle. In one process the order is pytest's own. COST holds the
seconds a module took in a full run on this 2-core machine (`--timing-report`, rounded);
a module not listed costs 0 and keeps its place after them. A wrong or stale figure costs
only some of the overlap, never a test.

The order is the same in every process (xdist checks that each collected the same tests)
and keeps each module's own tests in the order pytest gave them (module-scoped fixtures
are grouped by their parameter there)."""

from __future__ import annotations

import pytest

COST: dict[str, int] = {
    "tests/chaos/test_chaos.py": 165,
    "tests/worker/test_e2e.py": 150,
    "tests/client/test_up_e2e.py": 90,
    "tests/worker/test_e2e_object_storage.py": 90,
    "tests/worker/test_e2e_pool.py": 75,
    "tests/worker/test_e2e_usercode.py": 60,
    "tests/deploy/test_slurm.py": 55,
    "tests/worker/test_e2e_sweeps.py": 55,
    "tests/worker/test_zygote.py": 50,
    "tests/trainer/test_trainer_resume.py": 45,
    "tests/worker/test_e2e_redis_restart.py": 40,
    "tests/client/test_readme_examples.py": 35,
    "tests/store/test_schema_wait.py": 30,
    "tests/worker/test_worker_metrics.py": 30,
    "tests/scheduler/test_hostile_torchvision_size.py": 28,
    "tests/trainer/test_trainer_script.py": 28,
    "tests/worker/test_hostile_sandbox.py": 27,
    "tests/trainer/test_trainer_gpu_paths.py": 25,
    "tests/web/test_dashboard_live.py": 25,
    "tests/storage/test_storage_s3.py": 24,
    "tests/worker/test_e2e_object_datasets.py": 24,
    "tests/web/test_dashboard.py": 24,
    "tests/trainer/test_trainer_lease.py": 23,
    "tests/worker/test_sandbox.py": 23,
    "tests/api/test_hostile_costs.py": 22,
    "tests/api/test_api_fuzz.py": 21,
    "tests/trainer/test_trainer_ddp.py": 21,
    "tests/worker/test_e2e_schema_watch.py": 21,
    "tests/chaos/test_soak_option.py": 20,
    "tests/worker/test_standby.py": 20,
    "tests/worker/test_hostile_events.py": 18,
    "tests/web/test_dashboard_sweeps.py": 16,
    "tests/api/test_sso.py": 16,
    "tests/worker/test_hostile_e2e.py": 14,
    "tests/store/test_sweeps_store.py": 13,
    "tests/client/test_hostile_demo_files.py": 13,
    "tests/store/test_store_migrations.py": 12,
    "tests/store/test_store_metrics_feed.py": 11,
    "tests/web/test_dashboard_organise.py": 11,
    "tests/api/test_api_asyncreads.py": 11,
    "tests/api/test_api_quota.py": 11,
}


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


@pytest.hookimpl(trylast=True)  # after every hook that adds, drops or groups tests
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not hasattr(config, "workerinput"):  # not an xdist worker: pytest's order
        return
    items.sort(key=lambda item: -COST.get(module_of(item.nodeid), 0))
