"""Serving a checkpoint file: Content-Length, a strong ETag (the file's sha256), single
byte ranges (206) for resumable downloads, 416 past the end, If-None-Match (304) and
If-Range. A Range with several ranges, or one that does not parse, is ignored and the
whole file is sent with 200, as RFC 9110 allows."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from fastapi import Response
from fastapi.responses import StreamingResponse

from torchyard.api.errors import ApiError

CHUNK = 1 << 20
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


class Unsatisfiable(Exception):
    pass


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """The one byte range asked for as (first, last) inclusive, None to send the whole
    file, Unsatisfiable when no byte of the file is in it."""
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    first, dash, last = spec.strip().partition("-")
    if not dash or not (first.isdigit() or last.isdigit()):
        return None
    if not first:  # suffix: the last N bytes
        n = int(last)
        if n == 0 or size == 0:
            raise Unsatisfiable
        return max(0, size - n), size - 1
    if not first.isdigit() or (last and not last.isdigit()):
        return None
    start = int(first)
    end = int(last) if last else size - 1
    if last and end < start:
        return None  # invalid: ignored
    if start >= size:
        raise Unsatisfiable
    return start, min(end, size - 1)


def _etag_matches(header: str, etag: str) -> bool:
    tags = [t.strip().removeprefix("W/") for t in header.split(",")]
    return "*" in tags or etag in tags


def _chunks(f: BinaryIO, start: int, length: int) -> Iterator[bytes]:
    try:
        f.seek(start)
        left = length
        while left > 0:
            data = f.read(min(CHUNK, left))
            if not data:
                break
            left -= len(data)
            yield data
    finally:
        f.close()


def file_response(
    path: Path,
    *,
    etag: str,
    filename: str,
    range_header: str | None,
    if_range: str | None,
    if_none_match: str | None,
) -> Response:
    base = {
        "ETag": etag,
        "Accept-Ranges": "bytes",
        "Content-Disposition": f'attachment; filename="{_SAFE_NAME.sub("_", filename)}"',
    }
    if if_none_match and _etag_matches(if_none_match, etag):
        return Response(status_code=304, headers={"ETag": etag})
    f = open(path, "rb")  # noqa: SIM115 - closed by _chunks once streamed
    try:
        size = os.fstat(f.fileno()).st_size
        use_range = range_header is not None and (if_range is None or if_range.strip() == etag)
        rng = parse_range(range_header, size) if use_range and range_header else None
    except Unsatisfiable:
        f.close()
        raise ApiError(
            416,
            f"range {range_header!r} is outside the file ({size} bytes)",
            headers={"Content-Range": f"bytes */{size}"},
            details={"size": size},
        ) from None
    except BaseException:
        f.close()
        raise
    if rng is None:
        start, length, status = 0, size, 200
        headers = {**base, "Content-Length": str(size)}
    else:
        start, length, status = rng[0], rng[1] - rng[0] + 1, 206
        headers = {
            **base,
            "Content-Length": str(length),
            "Content-Range": f"bytes {rng[0]}-{rng[1]}/{size}",
        }
    return StreamingResponse(
        _chunks(f, start, length),
        status_code=status,
        headers=headers,
        media_type="application/octet-stream",
    )
