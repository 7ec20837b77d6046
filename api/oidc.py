"""Single sign-on's relying party: what torchyard asks of the OpenID provider and what it
believes of the answers (the routes are api/routers/sso.py, the rows store/sso.py).

The provider is found by discovery (`<issuer>/.well-known/openid-configuration`, whose
`issuer` must be the configured one, OpenID Connect Discovery §4.3), kept METADATA_TTL_S;
its signing keys (JWKS) are kept until an ID token names a key id they lack, then fetched
again (at most every JWKS_MIN_REFRESH_S, so a flood of made-up key ids cannot make us flood
the provider). Every ID token is checked with joserfc and Authlib's OpenID claims rules:
the signature by the provider's keys (asymmetric algorithms only, never `none` or a MAC),
`iss` (the discovered issuer), `aud` (must hold our client id; `azp` too when it holds
several), `exp` and `iat` with LEEWAY_S of clock skew, the `nonce` of the sign-in, and
`at_hash` when present. Claims the ID token lacks (a provider may put the user's name and
groups only in its userinfo answer) are read from the userinfo endpoint with the access
token just issued, whose `sub` must be the ID token's.

The client secret goes to the provider's token and device endpoints only (HTTP basic, or
in the form where the provider supports only that). A provider that cannot be reached
answers OidcError 503: a sign-in fails clearly, and tokens and sessions work on.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import httpx
from authlib.oidc.core import CodeIDToken
from joserfc import jwt
from joserfc.errors import InvalidKeyIdError, JoseError
from joserfc.jwk import KeySet

from torchyard.settings import Settings
from torchyard.store.sso import Identity, StartedLogin

log = logging.getLogger(__name__)

LEEWAY_S = 60
METADATA_TTL_S = 3600.0
JWKS_MIN_REFRESH_S = 30.0
HTTP_TIMEOUT_S = 10.0
DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
ASYMMETRIC = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512",
              "EdDSA", "Ed25519")  # fmt: skip
# A user name: no control characters, no surrounding blanks (the store allows 100).
_NAME = re.compile(r"^[^\x00-\x1f\x7f\s](?:[^\x00-\x1f\x7f]{0,98}[^\x00-\x1f\x7f\s])?$")


def now() -> int:
    """The time ID tokens are checked at (tests move it to see an expired token)."""
    return int(time.time())


class OidcError(Exception):
    """A sign-in that cannot go on: the HTTP status and code the API answers with."""

    def __init__(self, status: int, message: str, code: str = "sso_refused"):
        self.status, self.message, self.code = status, message, code
        super().__init__(message)


class ProviderRefused(OidcError):
    """The provider answered an OAuth error (`error` is its code: invalid_grant,
    authorization_pending, …)."""

    def __init__(self, error: str, description: str):
        self.error, self.description = error, description
        said = f" ({description})" if description else ""
        super().__init__(401, f"the sign-in provider refused: {error}{said}")


@dataclass(frozen=True)
class Metadata:
    """What discovery tells of the provider (the parts torchyard uses)."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    userinfo_endpoint: str | None
    device_authorization_endpoint: str | None
    scopes_supported: tuple[str, ...] | None
    algorithms: tuple[str, ...]
    basic_auth: bool

    @classmethod
    def of(cls, doc: dict[str, Any], issuer: str) -> Metadata:
        if doc.get("issuer") != issuer:
            raise OidcError(
                503,
                f"the sign-in provider's discovery document names the issuer "
                f"{str(doc.get('issuer'))[:200]!r}, not TORCHYARD_OIDC_ISSUER {issuer!r}",
                "sso_unavailable",
            )
        try:
            need = {
                k: str(doc[k]) for k in ("authorization_endpoint", "token_endpoint", "jwks_uri")
            }
        except KeyError as e:
            raise OidcError(503, f"the sign-in provider's discovery document lacks {e}", "sso_unavailable") from None  # fmt: skip
        scopes = doc.get("scopes_supported")
        algs = doc.get("id_token_signing_alg_values_supported") or ["RS256"]
        methods = doc.get("token_endpoint_auth_methods_supported") or ["client_secret_basic"]
        return cls(
            issuer=issuer,
            **need,
            userinfo_endpoint=doc.get("userinfo_endpoint"),
            device_authorization_endpoint=doc.get("device_authorization_endpoint"),
            scopes_supported=tuple(scopes) if isinstance(scopes, list) else None,
            algorithms=tuple(a for a in algs if a in ASYMMETRIC),
            basic_auth="client_secret_basic" in methods or "client_secret_post" not in methods,
        )


def _unreachable(issuer: str, why: str) -> OidcError:
    return OidcError(503, f"the sign-in provider at {issuer} cannot be reached: {why}", "sso_unavailable")  # fmt: skip


class OidcClient:
    """torchyard as the provider's client, one per API process: discovery and keys cached,
    the token, device and userinfo calls, the ID token checks."""

    def __init__(self, settings: Settings):
        assert settings.oidc_issuer and settings.oidc_client_id
        self.issuer = settings.oidc_issuer  # compared exactly, as the spec says
        self.client_id = settings.oidc_client_id
        self.secret = settings.oidc_client_secret or ""
        self.scopes = settings.oidc_scopes.split()
        self.user_claim, self.groups_claim = settings.oidc_user_claim, settings.oidc_groups_claim
        self.name = settings.oidc_name or (httpx.URL(self.issuer).host or self.issuer)
        self._meta: tuple[float, Metadata] | None = None
        self._keys: tuple[float, KeySet] | None = None

    # -- talking to the provider ----------------------------------------------------------

    async def _request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        try:
            async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S, follow_redirects=False) as http:
                r = await http.request(method, url, **kw)
        except httpx.HTTPError as e:
            log.warning("single sign-on: %s %s failed: %s", method, url, type(e).__name__)
            raise _unreachable(self.issuer, type(e).__name__) from None
        if r.status_code >= 500:
            log.warning("single sign-on: %s %s answered HTTP %s", method, url, r.status_code)
            raise _unreachable(self.issuer, f"HTTP {r.status_code} from {url}")
        return r

    async def _json(self, method: str, url: str, **kw: Any) -> tuple[int, dict[str, Any]]:
        r = await self._request(method, url, **kw)
        try:
            body = r.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise _unreachable(self.issuer, f"HTTP {r.status_code} from {url} is not a JSON object")  # fmt: skip
        return r.status_code, body

    async def metadata(self) -> Metadata:
        if self._meta is not None and self._meta[0] > time.monotonic():
            return self._meta[1]
        url = self.issuer.rstrip("/") + "/.well-known/openid-configuration"
        status, doc = await self._json("GET", url)
        if status != 200:
            raise _unreachable(self.issuer, f"HTTP {status} from its discovery document")
        meta = Metadata.of(doc, self.issuer)
        self._meta = (time.monotonic() + METADATA_TTL_S, meta)
        return meta

    async def keys(self, force: bool = False) -> KeySet:
        """The provider's signing keys; `force`: fetched again unless that was just done."""
        cached = self._keys
        if cached is not None and (not force or cached[0] > time.monotonic()):
            return cached[1]
        meta = await self.metadata()
        status, doc = await self._json("GET", meta.jwks_uri)
        if status != 200:
            raise _unreachable(self.issuer, f"HTTP {status} from its JWKS")
        try:
            keys = KeySet.import_key_set(doc)  # type: ignore[arg-type]
        except (JoseError, ValueError, TypeError) as e:
            raise _unreachable(self.issuer, f"its JWKS cannot be read ({e})") from None
        self._keys = (time.monotonic() + JWKS_MIN_REFRESH_S, keys)
        return keys

    def _client_auth(self, meta: Metadata, form: dict[str, str]) -> dict[str, Any]:
        """The request's client authentication (RFC 6749 §2.3.1: basic, each part
        form-encoded first; or in the form)."""
        if meta.basic_auth:
            auth = (quote(self.client_id, safe=""), quote(self.secret, safe=""))
            return {"data": form, "auth": auth}
        return {"data": {**form, "client_id": self.client_id, "client_secret": self.secret}}

    async def _post(self, url: str, form: dict[str, str]) -> dict[str, Any]:
        meta = await self.metadata()
        status, body = await self._json("POST", url, **self._client_auth(meta, form))
        if status != 200 or "error" in body:
            raise ProviderRefused(
                str(body.get("error") or f"HTTP {status}")[:100],
                str(body.get("error_description") or "")[:300],
            )
        return body

    # -- the flows --------------------------------------------------------------------------

    def scope(self, meta: Metadata) -> str:
        """The configured scopes the provider supports (all of them when it lists none)."""
        wanted = ["openid", *(s for s in self.scopes if s != "openid")]
        if meta.scopes_supported is None:
            return " ".join(wanted)
        return " ".join(s for s in wanted if s == "openid" or s in meta.scopes_supported)

    async def authorization_url(self, started: StartedLogin, redirect_uri: str) -> str:
        meta = await self.metadata()
        params = {
            "response_type": "code",
            "client_id": self.client_id,
            "redirect_uri": redirect_uri,
            "scope": self.scope(meta),
            "state": started.state,
            "nonce": started.nonce,
            "code_challenge": started.code_challenge,
            "code_challenge_method": "S256",
        }
        sep = "&" if "?" in meta.authorization_endpoint else "?"
        return meta.authorization_endpoint + sep + urlencode(params)

    async def exchange_code(self, code: str, verifier: str, redirect_uri: str) -> dict[str, Any]:
        meta = await self.metadata()
        form = {"grant_type": "authorization_code", "code": code,
                "redirect_uri": redirect_uri, "code_verifier": verifier}  # fmt: skip
        return await self._post(meta.token_endpoint, form)

    async def device_start(self) -> dict[str, Any]:
        meta = await self.metadata()
        if not meta.device_authorization_endpoint:
            raise OidcError(404, "the sign-in provider offers no device sign-in (RFC 8628)",
                            "sso_no_device")  # fmt: skip
        return await self._post(meta.device_authorization_endpoint, {"scope": self.scope(meta)})

    async def device_poll(self, device_code: str) -> dict[str, Any]:
        meta = await self.metadata()
        form = {"grant_type": DEVICE_GRANT, "device_code": device_code}
        return await self._post(meta.token_endpoint, form)

    # -- what the answers are worth ---------------------------------------------------------

    async def verify_id_token(
        self, raw: str, nonce: str | None, access_token: str | None
    ) -> dict[str, Any]:
        """The ID token's claims once every check passed; OidcError 401 naming the first
        that failed."""
        meta = await self.metadata()
        try:
            try:
                token = jwt.decode(raw, await self.keys(), algorithms=list(meta.algorithms))
            except InvalidKeyIdError:  # the provider may have rotated its keys
                token = jwt.decode(raw, await self.keys(force=True), algorithms=list(meta.algorithms))  # fmt: skip
            options = {"iss": {"essential": True, "value": meta.issuer},
                       "aud": {"essential": True, "value": self.client_id},
                       "sub": {"essential": True}}  # fmt: skip
            params = {"nonce": nonce, "client_id": self.client_id, "access_token": access_token}
            claims = CodeIDToken(token.claims, token.header, options, params)
            claims.validate(now=now(), leeway=LEEWAY_S)
        except JoseError as e:
            what = f"{e.error}: {e.description}" if e.description else e.error
            raise OidcError(401, f"the sign-in provider's ID token was refused ({what})") from None
        except (ValueError, TypeError) as e:
            raise OidcError(401, f"the sign-in provider's ID token is malformed ({e})") from None
        if nonce is None and "nonce" in claims:
            raise OidcError(401, "the sign-in provider's ID token has a nonce no one sent")
        return dict(claims)

    async def _userinfo(self, access_token: str, sub: str) -> dict[str, Any]:
        meta = await self.metadata()
        if not meta.userinfo_endpoint:
            return {}
        headers = {"Authorization": f"Bearer {access_token}", "Accept": "application/json"}
        status, body = await self._json("GET", meta.userinfo_endpoint, headers=headers)
        if status != 200:
            raise OidcError(401, f"the sign-in provider's userinfo answered HTTP {status}")
        if body.get("sub") != sub:
            raise OidcError(401, "the sign-in provider's userinfo is of another account")
        return body

    async def identity(self, tokens: dict[str, Any], nonce: str | None) -> Identity:
        """Who a token answer (code or device grant) says signed in, checked."""
        raw, access = tokens.get("id_token"), tokens.get("access_token")
        if not isinstance(raw, str):
            raise OidcError(401, "the sign-in provider sent no ID token (is `openid` a scope?)")
        claims = await self.verify_id_token(raw, nonce, access if isinstance(access, str) else None)
        if (self.user_claim not in claims or self.groups_claim not in claims) and isinstance(access, str):  # fmt: skip
            info = await self._userinfo(access, claims["sub"])
            claims = {**info, **claims}
        return self._identity_of(claims)

    def _identity_of(self, claims: dict[str, Any]) -> Identity:
        name, sub = claims.get(self.user_claim), claims.get("sub")
        if not isinstance(name, str) or not _NAME.match(name):
            raise OidcError(403, f"the sign-in provider sent no usable {self.user_claim!r} "
                            "claim (the torchyard user name, TORCHYARD_OIDC_USER_CLAIM)")  # fmt: skip
        if not isinstance(sub, str) or not 0 < len(sub) <= 255:
            raise OidcError(401, "the sign-in provider's `sub` is not 1 to 255 characters")
        groups = claims.get(self.groups_claim) or []
        if isinstance(groups, str):
            groups = [groups]
        found = tuple(g for g in groups if isinstance(g, str)) if isinstance(groups, list) else ()
        return Identity(self.issuer, sub, name, found)
