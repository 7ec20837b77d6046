"""`torchyard scheduler [--tick SECONDS] [--reserve-after SECONDS]`: run the scheduler
process (scheduler/process.py)."""

from __future__ import annotations

import argparse

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
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.tick <= 0:
        p.error("--tick must be > 0")
    private_umask()
    setup_logging(args.log_level)
    settings = load_settings()
    if settings is None:
        return 2

    from torchyard.storage import check_storage

    if not check_storage(settings):
        return 2

    # Only now: the process loads Celery and the store, which `--help` never needs.
    from torchyard.scheduler.process import Scheduler

    return Scheduler(settings, tick_s=args.tick, reserve_after_s=args.reserve_after).run()
