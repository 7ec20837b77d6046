"""Serving a checkpoint file with Starlette's FileResponse (which reads Range and If-Range
itself): Content-Length, a strong ETag (the file's sha256), one byte range (206) for
resumable downloads, 416 past the end, If-None-Match (304). A Range with several ranges,
or one that does not parse, is ignored and the whole file is sent with 200, as RFC 9110
allows (and as this API has always documented)."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from fastapi import Response
from starlette.responses import FileResponse, MalformedRangeHeader, RangeNotSatisfiable

from torchyard.api.errors import ApiError

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


class _Download(FileResponse):
    # 64 KiB (Starlette's default) costs a send per 64 KiB: 1 MiB keeps a 1 GiB download
    # to ~1000 event-loop round trips.
    chunk_size = 1 << 20

    @classmethod
    def _parse_range_header(cls, http_range: str, file_size: int) -> list[tuple[int, int]]:
        """Starlette's parse, with this API's answers: a malformed Range or several ranges
        give the whole file ([]), an unsatisfiable one the JSON 416 error."""
        try:
            ranges = super()._parse_range_header(http_range, file_size)
        except MalformedRangeHeader:
            return []
        except RangeNotSatisfiable:
            raise ApiError(
                416,
                f"range {http_range!r} is outside the file ({file_size} bytes)",
                headers={"Content-Range": f"bytes */{file_size}"},
                details={"size": file_size},
            ) from None
        return ranges if len(ranges) == 1 else []


def _etag_matches(header: str, etag: str) -> bool:
    tags = [t.strip().removeprefix("W/") for t in header.split(",")]
    return "*" in tags or etag in tags


def file_response(path: Path, *, etag: str, filename: str, if_none_match: str | None) -> Response:
    """The file at `path` (FileNotFoundError if it is not a regular file now)."""
    if if_none_match and _etag_matches(if_none_match, etag):
        return Response(status_code=304, headers={"ETag": etag})
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise FileNotFoundError(path)
    return _Download(
        path,
        headers={"ETag": etag},
        media_type="application/octet-stream",
        filename=_SAFE_NAME.sub("_", filename),
        stat_result=st,
    )
