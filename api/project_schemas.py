"""Request and response bodies of the projects routes (api/routers/projects.py)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["viewer", "member", "owner"]


class ProjectIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$",
        description="letters, digits, '.', '_' or '-', starting with a letter or digit",
    )


class MemberIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Role = Field(description="viewer: reads; member: also submits and cancels; "
                       "owner: also manages members")  # fmt: skip


class MemberOut(BaseModel):
    user: str
    role: Role


class ProjectLimits(BaseModel):
    """A project's quota, as `GET /v1/projects/{name}/quota` answers it."""

    max_workers: int | None = Field(description="null: no limit")
    max_queued: int | None = Field(description="null: no limit")
    share: float


class ProjectUsage(BaseModel):
    """What the project's jobs (whoever submitted them) hold and wait for now."""

    running: int = Field(description="its jobs starting, running or cancelling")
    queued: int = Field(description="its queued jobs")
    workers: int = Field(description="workers its jobs hold (what `max_workers` limits)")
    worker_hours: float = Field(
        description="recent usage: worker-hours decayed with the fair-share half-life"
    )


class ProjectSummary(BaseModel):
    name: str
    personal: bool = Field(description="a user's own project, `~<user>`")
    role: Role | None = Field(description="the caller's (null: an admin who is no member)")
    members: int
    created_at: datetime
    quota: ProjectLimits
    usage: ProjectUsage


class ProjectOut(BaseModel):
    name: str
    personal: bool
    role: Role | None
    members: list[MemberOut] = Field(description="owners first")
    created_at: datetime
    quota: ProjectLimits | None = Field(default=None, description="null only after leaving it")
    usage: ProjectUsage | None = Field(default=None, description="null only after leaving it")


class ProjectList(BaseModel):
    items: list[ProjectSummary]
