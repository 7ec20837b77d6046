"""Code bundles: upload (a gzip-compressed tar of a user's code) and look one up.

An upload is streamed to a temporary file in the storage's staging folder for bundles
(`<storage>/bundles/tmp/` on local storage), hashed as it arrives, checked
(store/bundlefiles.py: check_archive refuses anything hostile) and only then stored as
`bundles/<sha256>.tar.gz` (on local storage, a rename). Nothing is written anywhere else,
and nothing of a refused or interrupted upload is left behind.

Uploading needs the permission to run one's own code (a bundle is nothing else), and what a
user keeps is bounded by TORCHYARD_MAX_BUNDLE_STORAGE_BYTES (413 past it; the scheduler
removes bundles unused for TORCHYARD_BUNDLE_RETENTION_S: store/bundles.py).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO

from fastapi import APIRouter, Request, Response
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import CurrentUser, Principal, ReadSessionDep, SettingsDep, actor_of
from torchyard.api.errors import ApiError, not_found, responses, validation_error
from torchyard.api.schemas import BundleOut
from torchyard.api.uploads import check_gzip_headers, receive_to
from torchyard.settings import Settings
from torchyard.storage import Storage, storage_for
from torchyard.storage.keys import BUNDLES
from torchyard.store.audit import Actor, record
from torchyard.store.bundlefiles import (
    BundleRejected,
    Manifest,
    archive_key,
    check_archive,
    names_key,
)
from torchyard.store.bundles import (
    BundleQuotaExceeded,
    get_bundle,
    record_bundle,
    storage_used,
    write_bundle_names,
)
from torchyard.store.models import Bundle

router = APIRouter(prefix="/v1/bundles", tags=["bundles"])

# The upload route limits its own body (TORCHYARD_MAX_BUNDLE_BYTES), not the JSON limit of
# the BodyLimit middleware: app.py exempts this path there.
UPLOAD_PATH = "/v1/bundles"


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


def _may_upload(user: Principal) -> None:
    """403 for a user who may not run their own code: a bundle is only ever run."""
    if not (user.is_admin or user.can_run_code):
        raise ApiError(
            403,
            "uploading a code bundle needs the permission to run your own code; an admin "
            "grants it with `torchyard token create --user NAME --can-run-code`",
            code="forbidden",
        )


def _over_quota(e: BundleQuotaExceeded) -> ApiError:
    return ApiError(
        413,
        str(e),
        code="quota_exceeded",
        details={"used_bytes": e.used, "bytes": e.size, "limit_bytes": e.quota},
    )


def _quota_check(
    factory: sessionmaker[Session], settings: Settings, owner_id: int, bundle_id: str, size: int
) -> None:
    """413 before the archive is checked when a bundle new to the owner would take them
    past their storage quota (checked again, under a lock, when the row is written)."""
    with factory() as session:
        if get_bundle(session, owner_id, bundle_id) is not None:
            return  # uploaded before: counted already
        used, quota = storage_used(session, owner_id), settings.max_bundle_storage_bytes
    if used + size > quota:
        raise _over_quota(BundleQuotaExceeded(used, size, quota))


def _open_temp(storage: Storage) -> tuple[IO[bytes], Path]:
    tmp_dir = storage.staging_dir(BUNDLES)
    fd, name = tempfile.mkstemp(dir=tmp_dir, prefix="upload-", suffix=".tar.gz")
    return os.fdopen(fd, "wb"), Path(name)


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
    factory: sessionmaker[Session],
    settings: Settings,
    owner_id: int,
    bundle: tuple[str, int, int],
    actor: Actor,
) -> bool:
    """Write the owner's row (bundle: id, bytes, files); True when new. Over the quota
    (a concurrent upload took the room): 413, and the kept archive is removed when no row
    of its id is left to need it."""
    bundle_id, size, files = bundle
    quota = settings.max_bundle_storage_bytes
    with factory() as session:
        try:
            created = record_bundle(session, owner_id, bundle_id, size, files, quota=quota)
        except BundleQuotaExceeded as e:
            session.rollback()
            if session.scalar(select(Bundle.id).where(Bundle.id == bundle_id).limit(1)) is None:
                storage = storage_for(settings)
                storage.delete(archive_key(bundle_id))
                storage.delete(names_key(bundle_id))
            raise _over_quota(e) from None
        if created:  # the same bytes again from the same user add nothing
            details = {"bytes": size, "files": files}
            record(session, actor, "bundle.upload", f"bundle:{bundle_id}", details)
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
        "(admins: any). Uploading needs the permission to run your own code (403). Your "
        "bundles may take at most TORCHYARD_MAX_BUNDLE_STORAGE_BYTES in all (413, code "
        "`quota_exceeded`); a bundle neither uploaded again nor named by a submitted job for "
        "TORCHYARD_BUNDLE_RETENTION_S, and named by no queued or running job, is removed."
    ),
    responses={
        200: {"model": BundleOut, "description": "you had uploaded this bundle before"},
        **responses(401, 403, 413, 415, 422, 503),
    },
)
async def upload_bundle(
    request: Request, response: Response, user: CurrentUser, settings: SettingsDep
) -> BundleOut:
    _may_upload(user)
    check_gzip_headers(request, settings.max_bundle_bytes, "a bundle", _too_large)
    out, tmp = await run_in_threadpool(_open_temp, storage_for(settings))
    state = request.app.state
    try:
        try:
            size, bundle_id = await receive_to(request, out, settings.max_bundle_bytes, _too_large)
        finally:
            await run_in_threadpool(out.close)
        await run_in_threadpool(
            _quota_check, state.read_sessions, settings, user.id, bundle_id, size
        )
        manifest = await run_in_threadpool(_check, tmp, settings)
        await run_in_threadpool(_keep, tmp, settings, bundle_id, manifest.names)
    finally:
        # Gone already when it was kept; a refused, duplicate or broken upload ends here.
        await run_in_threadpool(tmp.unlink, missing_ok=True)
    bundle = (bundle_id, size, manifest.files)
    actor = actor_of(request, user)
    created = await run_in_threadpool(_record, state.sessions, settings, user.id, bundle, actor)
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
