"""The worker fleet, as the store knows it. Every user sees every worker (the pool is
shared); a non-admin sees the job a worker runs only when it is their own (another user's
shows as null: the worker is busy, with nothing that names whose work it is)."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy.orm import Session

from torchyard.api.deps import CurrentUser, ReadSessionDep
from torchyard.api.errors import responses
from torchyard.api.schemas import WorkerList, WorkerOut
from torchyard.store.inventory import list_workers
from torchyard.store.projects import visible_job_ids

router = APIRouter(prefix="/v1/workers", tags=["workers"])


@router.get(
    "",
    response_model=WorkerList,
    summary="List workers",
    description="Every registered worker: host, pid, GPU, device, state, current job and "
    "last heartbeat (`next_cursor` is always null). A non-admin sees `current_job_id` only "
    "for their own jobs: a worker busy with another user's job shows null.",
    responses=responses(401, 503),
)
def list_workers_route(user: CurrentUser, session: ReadSessionDep) -> WorkerList:
    items = [WorkerOut.model_validate(w) for w in list_workers(session)]
    if not user.is_admin:
        mine = _own_jobs(session, user.id, {w.current_job_id for w in items} - {None})
        for w in items:
            if w.current_job_id not in mine:
                w.current_job_id = None
    return WorkerList(items=items, next_cursor=None)


def _own_jobs(session: Session, user_id: int, job_ids: set[str | None]) -> set[str | None]:
    """Which of `job_ids` the user may see: those of their projects (one indexed query)."""
    return set(visible_job_ids(session, user_id, job_ids))
