"""Code bundles: upload (a gzip-compressed tar of a user's code) and look one up.

An upload is streamed to a temporary file in the storage's staging folder for bundles
(`<storage>/bundles/tmp/` on local storage), hashed as it arrives, checked
(store/bundlefiles.py: check_archive refuses anything hostile) and only then stored as
`bundles/<sha256>.tar.gz` (on local storage, a rename). Nothing is written anywhere else,
and nothing of a refused or interrupted upload is left behind.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import IO

from fastapi import APIRouter, Request, Response
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import CurrentUser, ReadSessionDep, SettingsDep
from torchyard.api.errors import ApiError, not_found, responses, validation_error
from torchyard.api.schemas import BundleOut
from torchyard.settings import Settings
from torchyard.storage import Storage, storage_for
from torchyard.storage.keys import BUNDLES
from torchyard.store.bundlefiles import BundleRejected, Manifest, archive_key, check_archive
from torchyard.store.bundles import get_bundle, record_bundle, write_bundle_names

router = APIRouter(prefix="/v1/bundles", tags=["bundles"])

# The upload route limits its own body (TORCHYARD_MAX_BUNDLE_BYTES), not the JSON limit of
# the BodyLimit middleware: app.py exempts this path there.
UPLOAD_PATH = "/v1/bundles"
# application/x-gzip is the same format under its older name (some tools still send it).
GZIP_TYPES = frozenset({"application/gzip", "application/x-gzip"})
# Received bytes are written out in blocks this large, each in a worker thread: the event
# loop never blocks on the disk, and a 200 MiB upload costs ~200 thread hops, not ~3000.
WRITE_BLOCK = 1 << 20


def _too_large(limit: int) -> ApiError:
    # Connection: close, as the middleware does: the rest of the body was not read.
    return ApiError(
        413,
        f"bundle over {limit} bytes (TORCHYARD_MAX_BUNDLE_BYTES): leave data sets, "
        "checkpoints and environments out of the code directory (list them in "
        ".torchyardignore)",
        details={"limit_bytes": limit},
        headers={"Connection": "close"},
    )


def _check_headers(request: Request, limit: int) -> None:
    """415 for a body that is not declared gzip; 413 before reading anything for a declared
    Content-Length over the limit (a chunked body is counted as it arrives)."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in GZIP_TYPES:
        raise ApiError(
            415,
            f"a bundle is sent as Content-Type application/gzip, not {media_type or 'none'!r}",
        )
    try:
        declared = int(request.headers.get("content-length", "0"))
    except ValueError:
        declared = 0
    if declared > limit:
        raise _too_large(limit)


def _open_temp(storage: Storage) -> tuple[IO[bytes], Path]:
    tmp_dir = storage.staging_dir(BUNDLES)
    fd, name = tempfile.mkstemp(dir=tmp_dir, prefix="upload-", suffix=".tar.gz")
    return os.fdopen(fd, "wb"), Path(name)


async def _receive(request: Request, out: IO[bytes], limit: int) -> tuple[int, str]:
    """Stream the body into `out`: (bytes received, their sha256). 413 as soon as the
    count passes `limit`, without reading the rest."""
    digest, size, block = hashlib.sha256(), 0, bytearray()
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        digest.update(chunk)
        block += chunk
        if len(block) >= WRITE_BLOCK:
            await run_in_threadpool(out.write, bytes(block))
            block.clear()
    await run_in_threadpool(out.write, bytes(block))
    return size, digest.hexdigest()


def _check(path: Path, settings: Settings) -> Manifest:
    try:
        return check_archive(
            path, max_files=settings.max_bundle_files, max_bytes=settings.max_bundle_bytes
        )
    except BundleRejected as e:
        if e.status == 422:
            raise validation_error([("body", e.reason)], "bundle") from None
        raise ApiError(
            e.status,
            f"invalid bundle: {e.reason}",
            details=[{"field": "body", "message": e.reason}],
        ) from None


def _keep(tmp: Path, settings: Settings, bundle_id: str, names: list[str]) -> None:
    """Store the checked upload (durably: a crash cannot leave the row without its file),
    and write its names beside it. An archive already there has this very content (its
    name is its sha256): the upload is dropped instead."""
    storage, key = storage_for(settings), archive_key(bundle_id)
    if not storage.exists(key):
        storage.write_file(key, tmp, move=True)
    # Written again on every upload: a names file lost on the server is restored by one.
    write_bundle_names(storage, bundle_id, names)


def _record(
    factory: sessionmaker[Session], owner_id: int, bundle_id: str, size: int, files: int
) -> bool:
    with factory() as session:
        created = record_bundle(session, owner_id, bundle_id, size, files)
        session.commit()
        return created


# The body is described in words, not as an OpenAPI requestBody: schemathesis, which fuzzes
# every route from the schema (tests/api/test_api_fuzz.py), cannot make gzip bodies.
@router.post(
    "",
    status_code=201,
    response_model=BundleOut,
    summary="Upload a code bundle",
    description=(
        "The body is a gzip-compressed tar of your code, sent as is with `Content-Type: "
        "application/gzip` (else 415); `torchyard submit --code DIR` packs one "
        "reproducibly, so the same tree gives the same id. At most "
        "TORCHYARD_MAX_BUNDLE_BYTES as sent (else 413) and unpacked, and at most "
        "TORCHYARD_MAX_BUNDLE_FILES entries. An archive with a member that could leave the "
        "bundle (absolute or `..` paths, links pointing out, devices) or shadow `torchyard` "
        "is refused with 422 naming it. The bundle's id is the sha256 of the body: name it "
        "in a job as `code.bundle`. 201 for a bundle new to you; 200 with the same body "
        "when you had uploaded it before. A job may name only bundles its owner uploaded "
        "(admins: any)."
    ),
    responses={
        200: {"model": BundleOut, "description": "you had uploaded this bundle before"},
        **responses(401, 413, 415, 422, 503),
    },
)
async def upload_bundle(
    request: Request, response: Response, user: CurrentUser, settings: SettingsDep
) -> BundleOut:
    _check_headers(request, settings.max_bundle_bytes)
    out, tmp = await run_in_threadpool(_open_temp, storage_for(settings))
    try:
        try:
            size, bundle_id = await _receive(request, out, settings.max_bundle_bytes)
        finally:
            await run_in_threadpool(out.close)
        manifest = await run_in_threadpool(_check, tmp, settings)
        await run_in_threadpool(_keep, tmp, settings, bundle_id, manifest.names)
    finally:
        # Gone already when it was kept; a refused, duplicate or broken upload ends here.
        await run_in_threadpool(tmp.unlink, missing_ok=True)
    created = await run_in_threadpool(
        _record, request.app.state.sessions, user.id, bundle_id, size, manifest.files
    )
    if not created:
        response.status_code = 200
    return BundleOut(id=bundle_id, bytes=size, files=manifest.files)


@router.get(
    "/{bundle_id}",
    response_model=BundleOut,
    summary="Show a code bundle",
    description="Its size as uploaded and its number of files. 404 for an unknown id and for "
    "a bundle you did not upload (admins see every bundle): `torchyard submit --code DIR` "
    "asks this first and uploads only on 404.",
    responses=responses(401, 404, 503),
)
def get_bundle_route(bundle_id: str, user: CurrentUser, session: ReadSessionDep) -> BundleOut:
    row = get_bundle(session, None if user.is_admin else user.id, bundle_id)
    if row is None:
        raise not_found("bundle")
    return BundleOut(id=row.id, bytes=row.bytes, files=row.files)
