"""A job's checkpoints: the list, and resumable downloads (read through the storage seam:
the file itself where storage is local, else streamed from it)."""

from __future__ import annotations

import logging
from pathlib import PurePosixPath
from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Response
from fastapi.responses import RedirectResponse

from torchyard.api.deps import CurrentUser, ReadSessionDep, SettingsDep
from torchyard.api.errors import ApiError, not_found, responses
from torchyard.api.files import file_response, stored_response
from torchyard.api.schemas import CheckpointList, CheckpointOut
from torchyard.storage import UnsafePath, storage_for
from torchyard.store.checkpoints import (
    checkpoint_available,
    checkpoint_file,
    checkpoint_key,
    get_checkpoint,
    latest_checkpoint,
    list_checkpoints,
)
from torchyard.store.jobs import get_job

PRESIGN_S = 3600  # a redirect's presigned URL outlives a slow download's start, not a day

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["checkpoints"])


@router.get(
    "/{job_id}/checkpoints",
    response_model=CheckpointList,
    summary="List checkpoints",
    description="Every checkpoint still on record, oldest step first (`next_cursor` is "
    "always null: the list is short).",
    responses=responses(401, 404, 503),
)
def list_checkpoints_route(
    job_id: str, user: CurrentUser, session: ReadSessionDep, settings: SettingsDep
) -> CheckpointList:
    if get_job(session, user.viewer, job_id) is None:
        raise not_found()
    storage = storage_for(settings)
    items = []
    for row in list_checkpoints(session, job_id):
        available = checkpoint_available(storage, row)
        items.append(
            CheckpointOut(
                id=row.id,
                step=row.step,
                epoch=row.epoch,
                kind=row.kind,
                bytes=row.bytes,
                sha256=row.sha256,
                attempt=row.attempt,
                path=row.path,
                created_at=row.created_at,
                available=available,
            )
        )
    return CheckpointList(items=items, next_cursor=None)


@router.get(
    "/{job_id}/checkpoints/{checkpoint}/download",
    response_class=Response,
    summary="Download a checkpoint",
    description=(
        "`checkpoint` is an id from the list, or `latest`: the newest (highest step) "
        "checkpoint of `kind` (default `resume`, the full training state; `weights` is the "
        "final safetensors export). Sends Content-Length, `ETag` (the quoted sha256) and "
        "`Accept-Ranges`. One byte range (`Range: bytes=a-b`, `a-`, `-n`) gives 206 with "
        "Content-Range, a range past the end 416; several ranges are ignored (200, whole "
        "file). `If-None-Match` with the ETag gives 304; `If-Range` is honoured. A stored "
        "path that leaves the job's directory, or goes through a symbolic link, is refused "
        "(404, `file_refused`), never served."
    ),
    responses={
        200: {"content": {"application/octet-stream": {}}, "description": "the whole file"},
        206: {"content": {"application/octet-stream": {}}, "description": "one byte range"},
        304: {"description": "If-None-Match matched the ETag"},
        **responses(401, 404, 416, 422, 503),
    },
)
def download_checkpoint(
    job_id: str,
    checkpoint: str,
    user: CurrentUser,
    session: ReadSessionDep,
    settings: SettingsDep,
    kind: Annotated[Literal["resume", "weights"], Query()] = "resume",
    # Range and If-Range: read by the FileResponse itself for a local file, by
    # stored_response otherwise; declared for the schema and their length limits.
    range_: Annotated[str | None, Header(alias="Range", max_length=200)] = None,
    if_range: Annotated[str | None, Header(alias="If-Range", max_length=200)] = None,
    if_none_match: Annotated[str | None, Header(alias="If-None-Match", max_length=1000)] = None,
) -> Response:
    if get_job(session, user.viewer, job_id) is None:
        raise not_found()
    if checkpoint == "latest":
        row = latest_checkpoint(session, job_id, kind)
    elif checkpoint.isdigit() and len(checkpoint) <= 9:
        row = get_checkpoint(session, job_id, int(checkpoint))
    else:
        row = None
    if row is None:
        raise not_found("checkpoint")
    storage = storage_for(settings)
    name = f"{job_id}-{PurePosixPath(row.path).name}"
    etag = f'"{row.sha256}"'
    try:
        key = checkpoint_key(storage, row)
        if settings.download_redirect and (url := storage.presign(key, PRESIGN_S, filename=name)):
            # Straight from the object store: the client keeps Range, and checks the sha256.
            return RedirectResponse(url, status_code=307, headers={"ETag": etag})
        if checkpoint_file(storage, row) is not None:
            # A local file: opened once, no link followed; FileResponse serves that
            # descriptor (its own Range), never the path again.
            opened = storage.open_read(key)
            return file_response(opened, etag=etag, filename=name, if_none_match=if_none_match)
        return stored_response(
            storage,
            key,
            etag=etag,
            filename=name,
            if_none_match=if_none_match,
            range_=range_,
            if_range=if_range,
        )
    except UnsafePath as e:
        log.warning("refused to serve checkpoint %s of job %s: %s", row.id, job_id, e)
        raise ApiError(
            404,
            "checkpoint file refused: its path leaves the job's directory or is a link",
            code="file_refused",
        ) from None
    except OSError:
        # keep_last pruned it between the check and the open: the same answer.
        raise _gone() from None


def _gone() -> ApiError:
    return ApiError(404, "checkpoint file is no longer on disk", code="file_gone")
