"""Serving a stored file for download: Content-Length, a strong ETag (the file's sha256),
one byte range (206) for resumable downloads, 416 past the end, If-Range, If-None-Match
(304). A Range with several ranges, or one that does not parse, is ignored and the whole
file is sent with 200, as RFC 9110 allows (and as this API has always documented).

An object with a local file (the local backend: `Storage.local_path`) is served by
Starlette's FileResponse, which reads Range and If-Range itself; any other is streamed from
the storage in blocks (`stored_response`), with the same headers and answers. The local file
is served from the one descriptor the storage opened (no link followed: storage/local.py),
never reopened by name, so a link swapped in after the check is never what is sent.

Every download says `X-Content-Type-Options: nosniff`. A job's own file (an artifact) is
`application/octet-stream` and an attachment unless its first bytes are a PNG, JPEG, GIF or
WebP image (`sniff_image`): then that image type, inline, under a CSP that runs nothing."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import stat
import threading
from collections.abc import AsyncIterator, Generator
from email.utils import formatdate
from typing import Any, BinaryIO

import anyio
from fastapi import Response
from starlette.responses import (
    FileResponse,
    MalformedRangeHeader,
    RangeNotSatisfiable,
    StreamingResponse,
)
from starlette.types import Receive, Scope, Send

from torchyard.api.errors import ApiError
from torchyard.storage import ObjectInfo, Storage

_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


class _Download(FileResponse):
    """FileResponse over a file already open: read from its descriptor, closed when the
    response ends (or with the object, if it is never sent); never reopened by its path."""

    # 64 KiB (Starlette's default) costs a send per 64 KiB: 1 MiB keeps a 1 GiB download
    # to ~1000 event-loop round trips.
    chunk_size = 1 << 20

    def __init__(self, file: BinaryIO, **kw: Any) -> None:
        self._file = file
        super().__init__(f"/dev/fd/{file.fileno()}", **kw)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._file.close()

    @contextlib.asynccontextmanager
    async def _open_file(self) -> AsyncIterator[anyio.AsyncFile[bytes]]:
        yield anyio.wrap_file(self._file)

    async def _handle_simple(self, send: Send, send_header_only: bool, send_pathsend: bool) -> None:
        # never "pathsend": the server would open the path itself
        await super()._handle_simple(send, send_header_only, False)

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


OCTET = "application/octet-stream"
# Magic numbers of the image types a browser shows and never runs (no SVG: it is a document).
_IMAGES = ((b"\x89PNG\r\n\x1a\n", "image/png"), (b"\xff\xd8\xff", "image/jpeg"),
           (b"GIF87a", "image/gif"), (b"GIF89a", "image/gif"))  # fmt: skip
SNIFF_BYTES = 12
_NO_RUN = {"X-Content-Type-Options": "nosniff"}
_IMAGE_HEADERS = {**_NO_RUN, "Content-Security-Policy": "default-src 'none'; sandbox"}


def sniff_image(head: bytes) -> str | None:
    """The image type of a file that starts with `head` (its first SNIFF_BYTES), or None."""
    if len(head) >= 12 and head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    return next((t for magic, t in _IMAGES if head.startswith(magic)), None)


def _etag_matches(header: str, etag: str) -> bool:
    tags = [t.strip().removeprefix("W/") for t in header.split(",")]
    return "*" in tags or etag in tags


def file_response(
    file: BinaryIO,
    *,
    etag: str,
    filename: str,
    if_none_match: str | None,
    media_type: str = OCTET,
) -> Response:
    """The open local file `file` (the response closes it; FileNotFoundError, and closed,
    if it is not a regular file). `media_type` other than OCTET: an image shown inline."""
    st = os.fstat(file.fileno())
    if not stat.S_ISREG(st.st_mode) or (if_none_match and _etag_matches(if_none_match, etag)):
        file.close()
        if not stat.S_ISREG(st.st_mode):
            raise FileNotFoundError(filename)
        return Response(status_code=304, headers={"ETag": etag})
    return _Download(
        file,
        headers={"ETag": etag, **(_NO_RUN if media_type == OCTET else _IMAGE_HEADERS)},
        media_type=media_type,
        filename=_SAFE_NAME.sub("_", filename),
        stat_result=st,
        content_disposition_type="attachment" if media_type == OCTET else "inline",
    )


READ_AHEAD = 4  # blocks read from the store ahead of the client (4 MiB a download at most)


async def _read_ahead(f: BinaryIO, length: int) -> AsyncIterator[bytes]:
    """`_blocks`, read by a thread of its own at most READ_AHEAD blocks ahead of the sends:
    the store's reads and the client's writes overlap instead of taking turns. The thread
    stops within a block once the response is closed (a client gone). No task group spans
    the yields: the generator may be closed from another task (asyncio's finaliser)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
    slots, stop = threading.Semaphore(READ_AHEAD), threading.Event()

    def hand(item: bytes | BaseException | None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody is waiting
            loop.call_soon_threadsafe(ready.put_nowait, item)

    def produce() -> None:
        blocks = _blocks(f, length)
        try:
            while slots.acquire() and not stop.is_set():
                block = next(blocks, None)
                hand(block)
                if block is None:
                    return
        except BaseException as e:  # the store failed mid-stream: the response is cut short
            hand(e)
        finally:
            blocks.close()  # closes f

    threading.Thread(target=produce, name="download-read-ahead", daemon=True).start()
    try:
        while (item := await ready.get()) is not None:
            slots.release()
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        slots.release()


def _blocks(f: BinaryIO, length: int) -> Generator[bytes, None, None]:
    """`length` bytes of the open stream `f`, in `_Download.chunk_size` blocks (read in a
    worker thread by StreamingResponse), then closed; a shorter object ends the body early."""
    with f:
        while length > 0:
            block = f.read(min(_Download.chunk_size, length))
            if not block:
                return
            length -= len(block)
            yield block


def _wanted_range(
    info: ObjectInfo, headers: dict[str, str], range_: str | None, if_range: str | None
) -> tuple[int, int] | None:
    """The one byte range to send (start, end exclusive), None for the whole object: as
    FileResponse decides (If-Range names the ETag or the Last-Modified date, never weak)."""
    if range_ is None:
        return None
    if if_range is not None and (
        if_range.startswith("W/") or if_range not in (headers["ETag"], headers["Last-Modified"])
    ):
        return None
    ranges = _Download._parse_range_header(range_, info.size)
    return ranges[0] if ranges else None


def stored_response(
    storage: Storage,
    key: str,
    *,
    etag: str,
    filename: str,
    if_none_match: str | None,
    range_: str | None,
    if_range: str | None,
    media_type: str = OCTET,
) -> Response:
    """The object `key` streamed from `storage` (FileNotFoundError if it is gone), for a
    backend without local files: the answers of `file_response`."""
    if if_none_match and _etag_matches(if_none_match, etag):
        return Response(status_code=304, headers={"ETag": etag})
    info = storage.stat(key)
    shown = "attachment" if media_type == OCTET else "inline"
    headers = {
        "ETag": etag,
        "Accept-Ranges": "bytes",
        "Content-Disposition": f'{shown}; filename="{_SAFE_NAME.sub("_", filename)}"',
        "Last-Modified": formatdate(info.mtime, usegmt=True),
        **(_NO_RUN if media_type == OCTET else _IMAGE_HEADERS),
    }
    wanted = _wanted_range(info, headers, range_, if_range)
    start, end, status = 0, info.size, 200
    if wanted is not None:
        (start, end), status = wanted, 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{info.size}"
    headers["Content-Length"] = str(end - start)
    # Opened before the response starts: an object gone by now is still a clean 404.
    body = storage.open_read(key, start, end - start)
    return StreamingResponse(
        _read_ahead(body, end - start),
        status_code=status,
        headers=headers,
        media_type=media_type,
    )
