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


class ProjectSummary(BaseModel):
    name: str
    personal: bool = Field(description="a user's own project, `~<user>`")
    role: Role | None = Field(description="the caller's (null: an admin who is no member)")
    members: int
    created_at: datetime


class ProjectOut(BaseModel):
    name: str
    personal: bool
    role: Role | None
    members: list[MemberOut] = Field(description="owners first")
    created_at: datetime


class ProjectList(BaseModel):
    items: list[ProjectSummary]
