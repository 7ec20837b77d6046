"""`torchyard api [--host H] [--port P]`: serve the API with uvicorn."""

from __future__ import annotations

import argparse
import gc
import sys


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="torchyard api", description="serve the REST API")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--log-level", default="info", help="uvicorn log level")
    args = parser.parse_args(argv)

    import uvicorn

    from torchyard.api.app import create_app
    from torchyard.settings import get_settings, private_umask
    from torchyard.storage import check_storage

    private_umask()
    settings = get_settings()  # validated now, so a bad variable fails before binding
    if not check_storage(settings):
        return 2
    from torchyard.store.migrate import start_schema_watch, wait_for_schema

    if (why := wait_for_schema(settings.db_url, settings.schema_wait_s)) is not None:
        print(f"torchyard api: {why}", file=sys.stderr)
        return 2
    start_schema_watch(settings.db_url, settings.schema_watch_s, "api")
    app = create_app(settings)
    freeze_startup_heap()
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        proxy_headers=False,
    )
    return 0


def freeze_startup_heap() -> None:
    """Moves what start-up built (modules, the app, its routes and models: it lives as long
    as the process) out of the garbage collector's reach. A full collection then walks only
    what requests allocated: ~2 ms instead of ~45 ms, which at a few thousand requests a
    second stalled the event loop, and every request in flight, about once a second
    (bench/api_bench.py's p99). Here, not in the app's lifespan: a test process that builds
    many apps must keep collecting the ones it drops."""
    gc.collect()
    gc.freeze()
