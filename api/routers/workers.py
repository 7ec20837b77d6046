"""The worker fleet, as the store knows it."""

from __future__ import annotations

from fastapi import APIRouter

from torchyard.api.deps import CurrentUser, ReadSessionDep
from torchyard.api.errors import responses
from torchyard.api.schemas import WorkerList, WorkerOut
from torchyard.store.inventory import list_workers

router = APIRouter(prefix="/v1/workers", tags=["workers"])


@router.get(
    "",
    response_model=WorkerList,
    summary="List workers",
    description="Every registered worker: host, pid, GPU, device, state, current job and "
    "last heartbeat (`next_cursor` is always null).",
    responses=responses(401, 503),
)
def list_workers_route(user: CurrentUser, session: ReadSessionDep) -> WorkerList:
    del user  # any authenticated user may see the fleet
    return WorkerList(
        items=[WorkerOut.model_validate(w) for w in list_workers(session)], next_cursor=None
    )
