"""What the routes that take a gzip body share (POST /v1/bundles, POST /v1/datasets): the
Content-Type and declared-length checks before anything is read, and streaming the body to
a file under a byte limit, hashed as it arrives. Each route says what it takes and how its
413 reads."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import IO

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from torchyard.api.errors import ApiError

# application/x-gzip is the same format under its older name (some tools still send it).
GZIP_TYPES = frozenset({"application/gzip", "application/x-gzip"})
# Received bytes are written out in blocks this large, each in a worker thread: the event
# loop never blocks on the disk, and a 200 MiB upload costs ~200 thread hops, not ~3000.
WRITE_BLOCK = 1 << 20

TooLarge = Callable[[int], ApiError]  # the route's 413 for a limit


def check_gzip_headers(request: Request, limit: int, what: str, too_large: TooLarge) -> None:
    """415 for a body that is not declared gzip; 413 before reading anything for a declared
    Content-Length over the limit (a chunked body is counted as it arrives)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in GZIP_TYPES:
        raise ApiError(
            415,
            f"{what} is sent as Content-Type application/gzip, not {media_type or 'none'!r}",
        )
    try:
        declared = int(request.headers.get("content-length", "0"))
    except ValueError:
        declared = 0
    if declared > limit:
        raise too_large(limit)


async def receive_to(
    request: Request, out: IO[bytes], limit: int, too_large: TooLarge
) -> tuple[int, str]:
    """Stream the body into `out`: (bytes received, their sha256). 413 as soon as the
    count passes `limit`, without reading the rest."""
    digest, size, block = hashlib.sha256(), 0, bytearray()
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        digest.update(chunk)
        block += chunk
        if len(block) >= WRITE_BLOCK:
            await run_in_threadpool(out.write, bytes(block))
            block.clear()
    await run_in_threadpool(out.write, bytes(block))
    return size, digest.hexdigest()
