"""Data sets sent over the API: POST /v1/datasets?name=NAME puts an ImageFolder set (a
gzip-compressed tar of train/<class>/<image>… and val/…) where this server's jobs read it
(store/dataupload.py: its data root, or the object store every worker pulls from).

Admins only: a set is shared by every job on the server. The body streams to a temporary
file in the storage's staging folder under TORCHYARD_MAX_DATASET_UPLOAD_BYTES (413 past it);
nothing of a refused or interrupted upload is left behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import IO

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from torchyard.api.deps import AdminUser, SettingsDep, actor_of
from torchyard.api.errors import ApiError, responses, validation_error
from torchyard.api.uploads import check_gzip_headers, receive_to
from torchyard.settings import Settings
from torchyard.storage import storage_for
from torchyard.store.audit import Actor, record
from torchyard.store.dataupload import (
    STAGING,
    Installed,
    UploadRefused,
    checked_name,
    install_upload,
)

router = APIRouter(prefix="/v1/datasets", tags=["datasets"])

# This route limits its own body (app.py exempts it from the JSON body limit).
UPLOAD_PATH = "/v1/datasets"


class DatasetOut(BaseModel):
    name: str = Field(description="the set's name in a spec: data.name")
    where: str = Field(description="the folder in the server's data root, or the object store")
    files: int = Field(description="files installed")
    classes: list[str] = Field(description="class folders, as the trainer finds them")


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"data set over {limit} bytes (TORCHYARD_MAX_DATASET_UPLOAD_BYTES)",
        details={"limit_bytes": limit},
        headers={"Connection": "close"},  # the rest of the body was not read
    )


def _open_temp(settings: Settings) -> tuple[IO[bytes], Path]:
    fd, name = tempfile.mkstemp(
        dir=storage_for(settings).staging_dir(STAGING), prefix="body-", suffix=".tar.gz"
    )
    return os.fdopen(fd, "wb"), Path(name)


def _install(settings: Settings, tmp: Path, name: str, force: bool) -> Installed:
    try:
        return install_upload(settings, tmp, name, force=force)
    except UploadRefused as e:
        if e.status == 422:
            raise validation_error([(e.field, e.reason)], "data set") from None
        raise ApiError(
            e.status, e.reason, details=[{"field": e.field, "message": e.reason}]
        ) from None


def _audit(request: Request, actor: Actor, done: Installed) -> None:
    with request.app.state.sessions() as session:
        details = {"files": done.files, "where": done.where}
        record(session, actor, "dataset.upload", f"dataset:{done.name}", details)
        session.commit()


@router.post(
    "",
    status_code=201,
    response_model=DatasetOut,
    summary="Upload an ImageFolder data set",
    description=(
        "Admins. The body is a gzip-compressed tar of the set's folder (`train/<class>/"
        "<image>…` and `val/<class>/<image>…`, the same classes in both), sent with "
        "`Content-Type: application/gzip` (else 415), at most "
        "TORCHYARD_MAX_DATASET_UPLOAD_BYTES as sent (413) and unpacked (422). `name` is "
        "NAME or imagefolder/NAME (letters, digits, `_`, `.`, `-`); jobs then name "
        "`data.name: imagefolder/NAME`. Links, devices, absolute or `..` members are "
        "refused (422 naming the member), as is a folder the trainer could not read. The "
        "set goes into the server's data root (TORCHYARD_DATA_ROOT), or into the object "
        "store when there is one; an existing set is kept (409) unless `force=true`."
    ),
    responses=responses(401, 403, 409, 413, 415, 422, 503),
)
async def upload_dataset(
    request: Request,
    user: AdminUser,
    settings: SettingsDep,
    name: str,
    force: bool = False,
) -> DatasetOut:
    try:
        checked_name(name)  # before reading the body
    except UploadRefused as e:
        raise validation_error([(e.field, e.reason)], "data set") from None
    limit = settings.max_dataset_upload_bytes
    check_gzip_headers(request, limit, "a data set", _too_large)
    out, tmp = await run_in_threadpool(_open_temp, settings)
    try:
        try:
            await receive_to(request, out, limit, _too_large)
        finally:
            await run_in_threadpool(out.close)
        done = await run_in_threadpool(_install, settings, tmp, name, force)
    finally:
        await run_in_threadpool(tmp.unlink, missing_ok=True)
    await run_in_threadpool(_audit, request, actor_of(request, user), done)
    return DatasetOut(name=done.name, where=done.where, files=done.files, classes=done.classes)
