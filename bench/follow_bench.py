"""SSE fan-out benchmark: N followers of one running job over real HTTP, and what they cost
the store.

    .venv/bin/python bench/follow_bench.py [--followers 1000] [--rate 20] [--seconds 5]
        [--poll-s 0.5] [--pg postgresql+psycopg://postgres@127.0.0.1:5432/postgres]

It makes a throw-away database (SQLite in a temp dir, or with --pg a PostgreSQL database
dropped at the end), serves the real app with uvicorn in a thread of this process on a
free loopback port, attaches N followers to `GET /v1/jobs/{id}/events` (raw asyncio
streams: little client CPU), writes one metric point `rate` times a second for `seconds`,
ends the job, and waits for every stream's `end` event. The server's read engine counts
its SQL statements (SQLAlchemy `before_cursor_execute`); a feed poll is one statement on
the metrics table. Prints: followers, events fed, events each follower received (all must
be equal), and store polls / SQL statements per poller tick while streaming. Goal: one
store poll per tick however many followers. The measurement is tests/support/follow.py's,
which tests/api/test_api_fanout.py runs too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchlib import scratch_postgres
from support.follow import FollowResult, measure

from torchyard.api.app import create_app
from torchyard.api.streams import RECHECK_S
from torchyard.settings import Settings
from torchyard.store.db import dispose_engines
from torchyard.store.migrate import upgrade


def report(r: FollowResult) -> None:
    metrics = sorted({c.get("metric", 0) for c in r.received})
    totals = sorted({sum(c.values()) for c in r.received})
    print(f"followers: {r.followers}")
    print(f"events fed: {r.fed} metric points (+ the state changes and `end`)")
    print(
        f"metric events received per follower: {metrics} (all equal: {len(metrics) == 1}); "
        f"events per follower: {totals}; distinct id sequences: {r.sequences}"
    )
    print(
        f"connect: {r.extra['connect_s']:.2f} s ({r.extra['shed']} connects shed with 503 and "
        f"retried), {r.connect_statements} SQL statements: {r.extra['connect_polls']} poller "
        "ticks' polls, the rest each follower's auth and visibility check"
    )
    print(
        f"streaming {r.seconds:.2f} s: {r.ticks} poller ticks, {r.polls} store polls, "
        f"{r.statements} SQL statements ({r.rechecks} of them the streams' re-checks, each "
        f"every {RECHECK_S:g} s) -> polls/tick = {r.polls / max(1, r.ticks):.2f}, "
        f"poller statements/tick = {(r.statements - r.rechecks) / max(1, r.ticks):.2f}"
    )


@contextmanager
def database(pg: str | None) -> Iterator[str]:
    """A migrated throw-away database."""
    if pg is None:
        with tempfile.TemporaryDirectory() as d:
            url = f"sqlite:///{d}/bench.db"
            upgrade(url)
            yield url
            dispose_engines()
        return
    with scratch_postgres(pg, f"ty_follow_{os.getpid()}") as url:
        yield url


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--followers", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=20.0, help="metric points per second")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--poll-s", type=float, default=0.5, help="the server's feed poll period")
    ap.add_argument("--pg", default=None, help="a PostgreSQL URL (default: SQLite)")
    args = ap.parse_args()
    if args.followers < 1 or args.rate <= 0 or args.seconds <= 0 or args.poll_s <= 0:
        ap.error("--followers, --rate, --seconds and --poll-s must be positive")
    with database(args.pg) as url, tempfile.TemporaryDirectory() as home:
        settings = Settings(
            _env_file=None,  # type: ignore[call-arg]
            home=Path(home),
            database_url=url,
            storage_root=Path(home) / "storage",
            broker_url=None,
            # one user follows N times here; the per-user cap (20 by default) would 429 it
            max_streams_per_user=args.followers,
        )
        app = create_app(settings)
        app.state.feed_poll_s = args.poll_s
        result = asyncio.run(measure(app, url, args.followers, args.rate, args.seconds))
    report(result)
    ok = len({c.get("metric", 0) for c in result.received}) == 1 and result.sequences == 1
    return 0 if ok and result.received[0].get("metric") == result.fed else 1


if __name__ == "__main__":
    raise SystemExit(main())
