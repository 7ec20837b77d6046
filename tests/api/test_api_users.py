"""`PATCH /v1/users/{name}` (api/routers/users.py): admins give and take back `admin` and
`can_run_code`; refusals change nothing; each change is audited once; the last admin stays
one. (Taking them back from cached tokens at once: test_hostile_permissions.py.)"""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import select
from support.db import Factory

from torchyard.store.db import session_scope
from torchyard.store.models import AuditEntry, User


def _grants(db_url: str) -> list[tuple[str, dict]]:
    with session_scope(db_url) as s:
        rows = s.scalars(select(AuditEntry).where(AuditEntry.action == "user.grant"))
        return [(e.target, e.details) for e in rows]


def _user(db_url: str, name: str) -> tuple[bool, bool]:
    with session_scope(db_url) as s:
        u = s.scalar(select(User).where(User.name == name))
        assert u is not None
        return u.is_admin, u.can_run_code


def test_an_admin_gives_and_takes_back_permissions(
    client: TestClient, factory: Factory, admin: dict[str, str], db_url: str
) -> None:
    alice = {"Authorization": f"Bearer {factory.token('alice')}"}
    assert client.get("/v1/ui/session", headers=alice).json()["can_run_code"] is False
    r = client.patch("/v1/users/alice", json={"can_run_code": True, "admin": True}, headers=admin)
    assert r.status_code == 200, r.text
    assert r.json() == {"user": "alice", "admin": True, "can_run_code": True}
    me = client.get("/v1/ui/session", headers=alice).json()
    assert (me["is_admin"], me["can_run_code"]) == (True, True)
    # absent fields are unchanged; the same values again are no change (no audit entry)
    r = client.patch("/v1/users/alice", json={"admin": False}, headers=admin)
    assert r.json() == {"user": "alice", "admin": False, "can_run_code": True}
    assert client.patch("/v1/users/alice", json={"admin": False}, headers=admin).status_code == 200
    assert client.patch("/v1/users/alice", json={}, headers=admin).status_code == 200
    assert _grants(db_url) == [
        ("user:alice", {"before": {"admin": False, "can_run_code": False},
                        "after": {"admin": True, "can_run_code": True}}),
        ("user:alice", {"before": {"admin": True}, "after": {"admin": False}}),
    ]  # fmt: skip
    assert client.get("/v1/ui/session", headers=alice).json()["is_admin"] is False


def test_refusals_change_nothing(
    client: TestClient, factory: Factory, admin: dict[str, str], db_url: str
) -> None:
    bob = {"Authorization": f"Bearer {factory.token('bob')}"}
    # bob is no admin, so not even for himself
    assert client.patch("/v1/users/bob", json={"admin": True}, headers=bob).status_code == 403
    assert client.patch("/v1/users/me", json={"admin": True}, headers=bob).status_code == 403
    r = client.patch("/v1/users/nobody", json={"admin": True}, headers=admin)
    assert r.status_code == 404 and "'nobody'" in r.json()["error"]["message"]
    for body in ({"admin": True, "quota": 1}, {"admin": "yes"}, {"can_run_code": 1}):
        r = client.patch("/v1/users/bob", json=body, headers=admin)
        assert r.status_code == 422, (body, r.text)
    # root is the only admin: taking it away would leave nobody to give it back
    r = client.patch("/v1/users/me", json={"admin": False, "can_run_code": True}, headers=admin)
    assert r.status_code == 409 and "last admin" in r.json()["error"]["message"], r.text
    assert _user(db_url, "root") == (True, False) and _user(db_url, "bob") == (False, False)
    assert _grants(db_url) == []
    # with another admin, root may step down
    assert client.patch("/v1/users/bob", json={"admin": True}, headers=admin).status_code == 200
    assert client.patch("/v1/users/root", json={"admin": False}, headers=admin).status_code == 200
    assert client.patch("/v1/users/bob", json={"admin": False}, headers=admin).status_code == 403
