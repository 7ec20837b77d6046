"""Job params in a real browser against a real API process (jobs and a script sweep over
`params.lr` written straight into the store as the controller leaves them): the jobs table
gets a column per param of the jobs it shows (the most common, at most 6), and a job's page
a table of its params."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dashboard_lib import SQLITE, backend_world, login, token_for
from seed import SPEC, SeedTrial, finished_job, sweep_trials, user_id
from support.worker_cluster import Cluster

from torchyard.store.sweeps import NewSweep, create_sweep

pytestmark = pytest.mark.browser

SHOTS = Path("/tmp/params-shots")  # where the lead looks at them (the `keep` fixture)
SCRIPT_SPEC: dict[str, Any] = {
    "code": {"bundle": "0" * 64},
    "entrypoint": {"script": "train.py", "args": ["--steps", "300"]},
    "params": {"arch": "wide", "dropout": 0.1},
}
LRS = [0.1, 0.01, 0.001]
CURVE = [(0, 0.5), (10, 0.8)]
NONE = "\N{EN DASH}"  # a cell without a value


class World:
    def __init__(self, c: Cluster):
        self.c, self.base = c, c.url
        self.alice = token_for(c, "alice")
        self.trials: list[str] = []
        self.plain = self.bare = ""


def _seed(w: World) -> World:
    with w.c.session() as s:
        uid = user_id(s, "alice")
        w.bare = finished_job(s, uid, "no-params")
        many = {f"p{i}": i for i in range(8)}  # more than the table shows: p0 … p5 only
        w.plain = finished_job(s, uid, "by-hand", {**SPEC, "params": {"lr": 0.5, **many}})
        sweep = create_sweep(s, uid, NewSweep(
            name="lr-sweep", spec=SCRIPT_SPEC, metric="val/accuracy", mode="max",
            space={"params.lr": {"type": "categorical", "choices": LRS}}, max_trials=3,
            parallel=3, sampler="grid", pruner="none", seed=0,
        ))  # fmt: skip
        trials = [SeedTrial({"params.lr": lr}, "succeeded", "complete", CURVE) for lr in LRS]
        w.trials = sweep_trials(s, sweep.id, trials)
    return w


@pytest.fixture(scope="module", params=[SQLITE])
def world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    yield from backend_world(request, tmp_path_factory, "params", lambda c: _seed(World(c)))


def _cells(page: Any, job_id: str) -> dict[str, str]:
    return dict(
        page.eval_on_selector_all(
            f"#jobs-table tr[data-id='{job_id}'] td.param",
            "tds => tds.map(t => [t.dataset.param, t.textContent])",
        )
    )


def test_the_jobs_table_shows_params_as_columns(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    page = new_page()
    login(page, world.base, world.alice, "/")
    page.wait_for_selector(f"#jobs-table tr[data-id='{world.bare}']")
    heads = page.eval_on_selector_all("#jobs-table thead th", "ths => ths.map(t => t.textContent)")
    # The most common first: every job with params has lr, the trials share arch and dropout;
    # of by-hand's own eight only the first three fit beside them (6 columns at most).
    params = ["lr", "arch", "dropout", "p0", "p1", "p2"]
    assert heads == ["", "name", "state", "progress", "train/loss", "val/accuracy", *params,
                     "workers", "age"]  # fmt: skip
    for job_id, lr in zip(world.trials, LRS, strict=True):
        assert _cells(page, job_id) == {"lr": str(lr), "arch": "wide", "dropout": "0.1",
                                        "p0": NONE, "p1": NONE, "p2": NONE}  # fmt: skip
    assert _cells(page, world.plain) == {"lr": "0.5", "p0": "0", "p1": "1", "p2": "2",
                                         "arch": NONE, "dropout": NONE}  # fmt: skip
    assert set(_cells(page, world.bare).values()) == {NONE}
    keep(page, "jobs-params")
    # Filtered to jobs without params, the table has no param column.
    page.fill("#job-filter", "no-params")
    page.wait_for_selector("#jobs-table th.param", state="detached")
    rows = page.eval_on_selector_all("#jobs-table tbody tr", "trs => trs.map(r => r.dataset.id)")
    assert rows == [world.bare]


def test_the_job_page_lists_its_params(
    world: World, new_page: Callable[[], Any], keep: Callable[[Any, str], None]
) -> None:
    page = new_page()
    login(page, world.base, world.alice, f"/jobs/{world.trials[1]}")
    page.wait_for_selector("#params")
    rows = page.eval_on_selector_all(
        "#params tr", "trs => trs.map(r => [r.dataset.param, r.querySelector('td').textContent])"
    )
    assert rows == [["arch", "wide"], ["dropout", "0.1"], ["lr", "0.01"]]
    keep(page, "job-params")
    page.goto(f"{world.base}/jobs/{world.bare}")
    page.wait_for_selector("#job-name")
    assert page.query_selector("#params") is None
