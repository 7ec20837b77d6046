"""What the API says about itself for clients that must not hard-code it: the job, attempt
and worker state lists and the job transition table, served from contracts/states.py."""

from __future__ import annotations

from fastapi import APIRouter

from torchyard.api.deps import CurrentUser
from torchyard.api.errors import responses
from torchyard.api.schemas import StateLists
from torchyard.contracts.states import state_lists

router = APIRouter(prefix="/v1", tags=["meta"])

# The lists never change while the process runs: built once.
STATE_LISTS = StateLists.model_validate(state_lists())


@router.get(
    "/states",
    response_model=StateLists,
    summary="State names and lists",
    description="Every job, attempt and worker state; which job states are terminal and "
    "active (holding workers), which attempt ends count against `max_restarts`, which "
    "worker states are live, and the job transition table.",
    responses=responses(401, 503),
)
async def states_route(user: CurrentUser) -> StateLists:
    del user  # any authenticated user may read them
    return STATE_LISTS
