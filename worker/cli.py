"""`torchyard worker (--gpu N | --device cpu) [--name ID] [--metrics-port PORT]`: run one
worker (worker/node.py), its Prometheus metrics served when a port is given
(worker/metrics.py). `torchyard scheduler` lives beside the scheduler (scheduler/cli.py)."""

from __future__ import annotations

import argparse
import sys

from torchyard.settings import load_settings, private_umask, setup_logging


def _worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchyard worker",
        description="Run one worker: a Celery worker (concurrency 1) on its own queue that "
        "runs one trainer at a time, pinned to one GPU (or a CPU slot). SIGTERM or Ctrl-C "
        "stops it cleanly: a running trainer checkpoints and its job goes back to the queue.",
    )
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument(
        "--gpu",
        type=int,
        metavar="N",
        help="the GPU to pin: nvidia-smi's index N (PCI bus order), or the N-th entry of an "
        "inherited CUDA_VISIBLE_DEVICES (e.g. from Slurm; MIG instances by UUID there); "
        "the trainer sees only that GPU, by UUID",
    )
    g.add_argument("--device", choices=["cpu"], help="a CPU slot (sees no GPU)")
    p.add_argument(
        "--name",
        metavar="ID",
        help="worker id (default: HOST-gpuN, or the first free HOST-cpuK); "
        "a restarted worker with the same id takes over its row",
    )
    p.add_argument(
        "--advertise-addr",
        metavar="ADDR",
        help="address other hosts use for this worker's rendezvous "
        "(default: $TORCHYARD_ADVERTISE_ADDR, else the host name's address)",
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


def worker_main(argv: list[str]) -> int:
    p = _worker_parser()
    args = p.parse_args(argv)
    if args.gpu is not None and args.gpu < 0:
        p.error("--gpu must be >= 0")
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
        print(f"torchyard worker: {why}", file=sys.stderr)
        return 2
    start_schema_watch(settings.db_url, settings.schema_watch_s, "worker")

    from torchyard.worker.identity import (
        SlotTaken,
        advertise_address,
        claim_id,
        cpu_device,
        gpu_device,
    )
    from torchyard.worker.node import WorkerNode

    try:
        wid, lock = claim_id(settings.home.resolve() / "locks", name=args.name, gpu=args.gpu)
    except (SlotTaken, ValueError) as e:
        print(f"torchyard worker: {e}", file=sys.stderr)
        return 2
    try:
        device = gpu_device(args.gpu) if args.gpu is not None else cpu_device()
    except ValueError as e:
        print(f"torchyard worker: {e}", file=sys.stderr)
        return 2
    node = WorkerNode(
        settings,
        wid,
        device,
        args.advertise_addr or advertise_address(settings.advertise_addr),
        lock,
    )
    port = args.metrics_port if args.metrics_port is not None else settings.metrics_port
    if port is not None:
        from torchyard.worker.metrics import serve

        if not serve(node.ctx.metrics.registry, port, settings.metrics_addr, "torchyard worker"):
            return 2
    return node.run()
