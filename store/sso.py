"""Single sign-on's rows: sign-ins under way, and who a provider account is.

A dashboard sign-in (`start_login`) stores the sha256 of its `state` with the nonce and
PKCE verifier sent on to the provider and the sha256 of a cookie given to the browser that
started it; `take_login` uses it once, within LOGIN_TTL_S, from that browser only (one
conditional DELETE, so two callbacks with one state cannot both win).

`sign_in` maps a verified identity (api/oidc.py) to a user by the provider account (issuer,
`sub`), never by name: a first sign-in makes the user the configured claim names and binds
the account to it; a name that is already a user's is refused (the claim is often the
account holder's own choice, so `preferred_username=admin` would otherwise be the admin),
and the refusal tells an admin how to link the account to that user (`link_identity`,
`PUT /v1/users/{name}/identity`) once they know it is theirs. Later the binding wins over
the name. The provider's groups are applied at each sign-in (`apply_groups`: admin only
through TORCHYARD_OIDC_ADMIN_GROUPS), then an ordinary API token is issued.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
import shlex
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from torchyard.store.audit import Actor, record
from torchyard.store.auth import get_or_create_user, hash_token, issue_token, user_named
from torchyard.store.models import (
    ApiToken,
    SsoLogin,
    UiSession,
    User,
    UserIdentity,
    utcnow,
)
from torchyard.store.projects import (
    RANK,
    ProjectError,
    project_named,
    remove_member,
    role_of,
    set_member,
)

LOGIN_TTL_S = 600.0
SSO_LABEL = "sso"  # the token behind a dashboard session made by SSO
SSO_CLI_LABEL = "sso-cli"  # the token `torchyard login URL --sso` saves


class SsoRefused(Exception):
    """A verified identity that may not sign in (its message says why, for the user)."""


class IdentityTaken(Exception):
    """A provider account an admin would link that is already another user's."""


@dataclass(frozen=True)
class StartedLogin:
    state: str
    nonce: str
    code_verifier: str

    @property
    def code_challenge(self) -> str:
        """PKCE S256: base64url(sha256(verifier)), unpadded."""
        digest = hashlib.sha256(self.code_verifier.encode("ascii")).digest()
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


@dataclass(frozen=True)
class PendingLogin:
    nonce: str
    code_verifier: str
    next_path: str | None


@dataclass(frozen=True)
class Identity:
    """Who the provider says signed in: its issuer, their `sub`, the user name (the
    configured claim) and their groups."""

    issuer: str
    subject: str
    name: str
    groups: tuple[str, ...] = ()


@dataclass(frozen=True)
class GroupRules:
    """TORCHYARD_OIDC_ADMIN_GROUPS and TORCHYARD_OIDC_PROJECT_ROLES."""

    admin_groups: frozenset[str] = frozenset()
    project_roles: tuple[tuple[str, str, str], ...] = ()


def start_login(session: Session, browser_secret: str, next_path: str | None) -> StartedLogin:
    """A new sign-in for the browser holding `browser_secret`: its state, nonce and PKCE
    verifier (the state stored only as its hash). Expired ones are purged first."""
    now = utcnow()
    session.execute(delete(SsoLogin).where(SsoLogin.expires_at < now))
    started = StartedLogin(
        secrets.token_urlsafe(32), secrets.token_urlsafe(32), secrets.token_urlsafe(64)
    )
    session.add(
        SsoLogin(
            state_hash=hash_token(started.state),
            browser_hash=hash_token(browser_secret),
            nonce=started.nonce,
            code_verifier=started.code_verifier,
            next_path=next_path,
            created_at=now,
            expires_at=now + timedelta(seconds=LOGIN_TTL_S),
        )
    )
    session.flush()
    return started


def take_login(session: Session, state: str, browser_secret: str) -> PendingLogin | None:
    """The sign-in of `state`, used up; None when it is unknown, expired, already used or
    was started by another browser."""
    if not state or len(state) > 200 or not browser_secret or len(browser_secret) > 200:
        return None
    row = session.execute(
        delete(SsoLogin)
        .where(
            SsoLogin.state_hash == hash_token(state),
            SsoLogin.browser_hash == hash_token(browser_secret),
            SsoLogin.expires_at > utcnow(),
        )
        .returning(SsoLogin.nonce, SsoLogin.code_verifier, SsoLogin.next_path)
    ).first()
    return None if row is None else PendingLogin(row[0], row[1], row[2])


def _identity_row(session: Session, issuer: str, subject: str) -> UserIdentity | None:
    return session.get(UserIdentity, (issuer, subject), with_for_update=True)


def bound_user(
    session: Session, ident: Identity, actor_client: str | None
) -> tuple[User, UserIdentity]:
    """The user the identity signs in as: the one its account is bound to, else a new user
    of its name, bound to it. SsoRefused when a user of that name exists (bound to another
    account, or to none: made with a token, or by an earlier account renamed since)."""
    row = _identity_row(session, ident.issuer, ident.subject)
    if row is not None:
        user = session.get(User, row.user_id)
        assert user is not None  # the foreign key cascades
        row.last_login_at = utcnow()
        return user, row
    if user_named(session, ident.name) is not None:
        raise SsoRefused(_not_linked(session, ident))
    user = get_or_create_user(session, ident.name)
    record(session, Actor(user.id, user.name, actor_client), "user.create",
           f"user:{user.name}", {"admin": False, "can_run_code": False, "via": "sso"})  # fmt: skip
    row = UserIdentity(issuer=ident.issuer, subject=ident.subject, user_id=user.id, granted={})
    session.add(row)
    session.flush()
    return user, row


def _not_linked(session: Session, ident: Identity) -> str:
    """The refusal of a first sign-in under an existing user's name: for the user, and for
    the admin they will ask (what to run once they know the account is that user's)."""
    linked = session.scalar(
        select(UserIdentity.subject)
        .join(User, User.id == UserIdentity.user_id)
        .where(UserIdentity.issuer == ident.issuer, User.name == ident.name)
    )
    whose = "exists and is not linked to this sign-in account"
    if linked is not None:
        whose = "is linked to another sign-in account"
    return (
        f"the torchyard user {ident.name!r} {whose} (subject {ident.subject!r}): ask an "
        "admin. If the user is yours, an admin links it with `torchyard user link "
        f"{shlex.quote(ident.name)} {shlex.quote(ident.subject)}`; else take another name "
        "at the sign-in provider"
    )


def link_identity(session: Session, user: User, issuer: str, subject: str) -> str | None:
    """Bind the account (`issuer`, `subject`) to `user` (an admin's doing): its next sign-in
    is as `user`. Replaces the user's link to another account of that issuer, keeping what
    its groups gave (so leaving a group still takes it back). Returns the subject linked
    before (None: none). IdentityTaken when the account is another user's."""
    row = _identity_row(session, issuer, subject)
    if row is not None and row.user_id != user.id:
        owner = session.get(User, row.user_id)
        raise IdentityTaken(
            f"subject {subject!r} is linked to the user {owner.name if owner else '?'!r}"
        )
    if row is not None:
        return subject
    old = session.scalar(
        select(UserIdentity)
        .where(UserIdentity.issuer == issuer, UserIdentity.user_id == user.id)
        .with_for_update()
    )
    granted: dict[str, Any] = {}
    if old is not None:
        granted = dict(old.granted or {})
        session.delete(old)
        session.flush()
    session.add(UserIdentity(issuer=issuer, subject=subject, user_id=user.id, granted=granted))
    session.flush()
    return None if old is None else old.subject


def _wanted_roles(groups: set[str], rules: GroupRules) -> dict[str, str]:
    """project → the highest role the user's groups give in it."""
    wanted: dict[str, str] = {}
    for group, project, role in rules.project_roles:
        if group in groups and RANK[role] > RANK.get(wanted.get(project, ""), -1):
            wanted[project] = role
    return wanted


def apply_groups(
    session: Session,
    user: User,
    row: UserIdentity,
    ident: Identity,
    rules: GroupRules,
    actor: Actor,
) -> None:
    """The provider's groups made true in torchyard: admin while in an admin group; at
    least each mapped role in each existing project. What an earlier sign-in's groups gave
    and the groups no longer give is taken back, unless changed by hand since (a role
    that is no longer the one given is left alone)."""
    groups = set(ident.groups)
    granted: dict[str, Any] = dict(row.granted or {})
    admin = bool(groups & rules.admin_groups)
    if admin and not user.is_admin:
        user.is_admin, granted["admin"] = True, True
        record(session, actor, "user.grant", f"user:{user.name}", {"admin": True, "via": "sso"})
    elif not admin and granted.get("admin"):
        granted["admin"] = False
        if user.is_admin:
            user.is_admin = False
            record(session, actor, "user.grant", f"user:{user.name}", {"admin": False, "via": "sso"})  # fmt: skip
    before: dict[str, str] = dict(granted.get("projects") or {})
    granted["projects"] = _give_roles(session, user, _wanted_roles(groups, rules), before, actor)
    for name, role in before.items():
        if name not in granted["projects"]:
            _take_role(session, user, name, role, actor)
    row.granted = granted


def _give_roles(
    session: Session, user: User, wanted: dict[str, str], before: dict[str, str], actor: Actor
) -> dict[str, str]:
    """Raise the user to each wanted role; returns the roles that are now the groups'."""
    given: dict[str, str] = {}
    for name, role in wanted.items():
        project = project_named(session, name)
        if project is None or project.personal_of is not None:
            continue  # only existing team projects; nothing is made from a group
        have = role_of(session, user.id, project.id)
        if have is not None and RANK[have] >= RANK[role]:
            if before.get(name) == have:  # still the groups' (raised by them earlier)
                given[name] = have
            continue
        try:
            set_member(session, project, user, role)
        except ProjectError:
            continue  # an owner lowered would leave no owner: left as it is
        record(session, actor, "project.member.set", f"project:{name}",
               {"user": user.name, "role": role, "before": have, "via": "sso"},
               project_id=project.id)  # fmt: skip
        given[name] = role
    return given


def _take_role(session: Session, user: User, name: str, role: str, actor: Actor) -> None:
    """Take back a role the groups gave, if it is still the one they gave."""
    project = project_named(session, name)
    if project is None or role_of(session, user.id, project.id) != role:
        return
    try:
        remove_member(session, project, user)
    except ProjectError:
        return  # the project's last owner stays one
    record(session, actor, "project.member.remove", f"project:{name}",
           {"user": user.name, "before": role, "via": "sso"}, project_id=project.id)  # fmt: skip


def retire_session_tokens(session: Session, user_id: int) -> None:
    """Revoke the user's dashboard SSO tokens whose sessions have all ended (expired): no
    one holds their secret, and they would only fill `torchyard token list`."""
    live = select(UiSession.token_id).where(UiSession.expires_at > utcnow())
    session.execute(
        update(ApiToken)
        .where(
            ApiToken.user_id == user_id,
            ApiToken.label == SSO_LABEL,
            ApiToken.revoked_at.is_(None),
            ApiToken.id.not_in(live),
        )
        .values(revoked_at=utcnow())
    )


def sign_in(
    session: Session, ident: Identity, rules: GroupRules, label: str, client: str | None
) -> tuple[User, ApiToken, str]:
    """The identity's user (bound, groups applied) and a new API token for them (`label`:
    SSO_LABEL for a dashboard session, SSO_CLI_LABEL for the CLI): (user, row, secret).
    SsoRefused when the account may not sign in; the caller commits."""
    try:
        user, row = bound_user(session, ident, client)
        actor = Actor(user.id, user.name, client)
        apply_groups(session, user, row, ident, rules, actor)
        if label == SSO_LABEL:
            retire_session_tokens(session, user.id)
        token_row, secret = issue_token(session, user.name, label=label)
    except IntegrityError:  # a first sign-in of the same account or name at the same time
        session.rollback()
        raise SsoRefused("another sign-in of this account is under way: try again") from None
    return user, token_row, secret


def session_sso_token(session: Session, secret: str) -> int | None:
    """The SSO token a dashboard session was made from (None: another kind of login),
    which the session's logout revokes: it was made for that session alone."""
    return session.scalar(
        select(UiSession.token_id)
        .join(ApiToken, ApiToken.id == UiSession.token_id)
        .where(UiSession.secret_hash == hash_token(secret), ApiToken.label == SSO_LABEL)
    )
