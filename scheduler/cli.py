"""`torchyard scheduler [--tick SECONDS] [--reserve-after SECONDS] [--metrics-port PORT]`: run
the scheduler process (scheduler/process.py), its Prometheus metrics served when a port is
given (scheduler/metrics.py)."""

from __future__ import annotations

import argparse
import sys

from torchyard.settings import load_settings, private_umask, setup_logging


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchyard scheduler",
        description="Give queued jobs to idle workers (gang-scheduled), reap workers whose "
        "heartbeat stopped, and re-send assignments whose message was lost. Several "
        "schedulers may run at once.",
    )
    p.add_argument(
        "--tick", type=float, default=2.0, metavar="SECONDS", help="periodic pass interval"
    )
    p.add_argument(
        "--reserve-after",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="a job waiting this long reserves idle workers (no more backfill past it)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics at http://TORCHYARD_METRICS_ADDR:PORT/metrics "
        "(default: TORCHYARD_METRICS_PORT; off when neither is set)",
    )
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.tick <= 0:
        p.error("--tick must be > 0")
    if args.metrics_port is not None and not 1 <= args.metrics_port <= 65535:
        p.error("--metrics-port must be 1 to 65535")
    private_umask()
    setup_logging(args.log_level)
    settings = load_settings()
    if settings is None:
        return 2

    from torchyard.storage import check_storage

    if not check_storage(settings):
        return 2
    from torchyard.store.migrate import start_schema_watch, wait_for_schema

    if (why := wait_for_schema(settings.db_url, settings.schema_wait_s)) is not None:
        print(f"torchyard scheduler: {why}", file=sys.stderr)
        return 2
    start_schema_watch(settings.db_url, settings.schema_watch_s, "scheduler")

    # Only now: the process loads Celery and the store, which `--help` never needs.
    from torchyard.scheduler.metrics import serve
    from torchyard.scheduler.process import Scheduler

    scheduler = Scheduler(settings, tick_s=args.tick, reserve_after_s=args.reserve_after)
    port = args.metrics_port if args.metrics_port is not None else settings.metrics_port
    if port is not None and not serve(
        scheduler.metrics.registry, port, settings.metrics_addr, "torchyard scheduler"
    ):
        return 2
    return scheduler.run()
