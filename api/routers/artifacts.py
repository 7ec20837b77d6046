"""A job's artifacts (`job.save_artifact`): the list and the download, read through the
storage seam as checkpoints are (api/routers/checkpoints.py), with the sha256 as ETag and
Range support. A file is served as the image it is only when its first bytes are a PNG,
JPEG, GIF or WebP image (api/files.py `sniff_image`), else as an attachment of type
application/octet-stream; always `nosniff`. Never a redirect to the object store: the
type sent is the one checked here."""

from __future__ import annotations

import logging
import os
from typing import Annotated

from fastapi import APIRouter, Header, Response

from torchyard.api.deps import CurrentUser, ReadSessionDep, SettingsDep
from torchyard.api.errors import ApiError, not_found, responses
from torchyard.api.files import OCTET, SNIFF_BYTES, file_response, sniff_image, stored_response
from torchyard.api.schemas import ArtifactList, ArtifactOut
from torchyard.contracts.eventmodel import artifact_name_problem
from torchyard.storage import UnsafePath, storage_for
from torchyard.store.artifacts import get_artifact, list_artifacts
from torchyard.store.checkpoints import checkpoint_available, checkpoint_file, checkpoint_key
from torchyard.store.jobs import get_job

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["artifacts"])


@router.get(
    "/{job_id}/artifacts",
    response_model=ArtifactList,
    summary="List artifacts",
    description="The files the job kept with `job.save_artifact`, by name, each with the "
    "sha256 and size its worker measured.",
    responses=responses(401, 404, 503),
)
def list_artifacts_route(
    job_id: str, user: CurrentUser, session: ReadSessionDep, settings: SettingsDep
) -> ArtifactList:
    if get_job(session, user.viewer, job_id) is None:
        raise not_found()
    storage = storage_for(settings)
    items = [
        ArtifactOut(name=row.name, bytes=row.bytes, sha256=row.sha256, path=row.path,
                    created_at=row.created_at, available=checkpoint_available(storage, row))
        for row in list_artifacts(session, job_id)
    ]  # fmt: skip
    return ArtifactList(items=items)


@router.get(
    "/{job_id}/artifacts/{name}/download",
    response_class=Response,
    summary="Download an artifact",
    description=(
        "The artifact's file, with Content-Length, `ETag` (the quoted sha256), one byte "
        "range (206) and `If-None-Match` (304), as a checkpoint download. A PNG, JPEG, GIF "
        "or WebP image (by its first bytes, not its name) is sent as that image type, "
        "inline; anything else as `application/octet-stream`, an attachment. Always "
        "`X-Content-Type-Options: nosniff`."
    ),
    responses={
        200: {"content": {"application/octet-stream": {}, "image/png": {}},
              "description": "the whole file"},
        206: {"content": {"application/octet-stream": {}}, "description": "one byte range"},
        304: {"description": "If-None-Match matched the ETag"},
        **responses(401, 404, 416, 422, 503),
    },
)  # fmt: skip
def download_artifact(
    job_id: str,
    name: str,
    user: CurrentUser,
    session: ReadSessionDep,
    settings: SettingsDep,
    range_: Annotated[str | None, Header(alias="Range", max_length=200)] = None,
    if_range: Annotated[str | None, Header(alias="If-Range", max_length=200)] = None,
    if_none_match: Annotated[str | None, Header(alias="If-None-Match", max_length=1000)] = None,
) -> Response:
    if get_job(session, user.viewer, job_id) is None:
        raise not_found()
    row = get_artifact(session, job_id, name) if artifact_name_problem(name) is None else None
    if row is None:
        raise not_found("artifact")
    storage = storage_for(settings)
    etag, filename = f'"{row.sha256}"', f"{job_id}-{row.name}"
    try:
        key = checkpoint_key(storage, row)
        if checkpoint_file(storage, row) is not None:
            # A local file: opened once, no link followed, sniffed and served from that
            # descriptor.
            opened = storage.open_read(key)
            media = sniff_image(os.pread(opened.fileno(), SNIFF_BYTES, 0)) or OCTET
            return file_response(opened, etag=etag, filename=filename,
                                 if_none_match=if_none_match, media_type=media)  # fmt: skip
        head, _ = storage.read_range(key, 0, SNIFF_BYTES)
        return stored_response(storage, key, etag=etag, filename=filename,
                               if_none_match=if_none_match, range_=range_, if_range=if_range,
                               media_type=sniff_image(head) or OCTET)  # fmt: skip
    except UnsafePath as e:
        log.warning("refused to serve artifact %s of job %s: %s", row.name, job_id, e)
        raise ApiError(404, "artifact file refused: its path is a link or leaves the job's "
                       "directory", code="file_refused") from None  # fmt: skip
    except OSError:
        raise ApiError(404, "artifact file is no longer in storage", code="file_gone") from None
