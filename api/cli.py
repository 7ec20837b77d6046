"""`torchyard api [--host H] [--port P]`: serve the API with uvicorn."""

from __future__ import annotations

import argparse


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="torchyard api", description="serve the REST API")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--log-level", default="info", help="uvicorn log level")
    args = parser.parse_args(argv)

    import uvicorn

    from torchyard.api.app import create_app
    from torchyard.store.settings import get_settings

    settings = get_settings()  # validated now, so a bad variable fails before binding
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        proxy_headers=False,
    )
    return 0
