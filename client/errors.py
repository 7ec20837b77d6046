"""Every error the torchyard SDK raises, in one tree:

    TorchyardError
    ├── ConnectError ......... the server could not be reached (refused, DNS, timeout)
    ├── SpecFileError ........ a local spec file is missing, unreadable, or not JSON/YAML
    ├── ConfigError .......... the login file (`torchyard login`) is unreadable or not valid
    ├── AmbiguousId .......... an id prefix that matches several jobs (sweeps, webhooks); `.matches`
    ├── ChecksumError ........ a downloaded file's sha256 differs from the server's
    └── APIError ............. the server answered with an error status
        ├── BadRequest ....... 400 / 413: the request itself was refused
        ├── Unauthorized ..... 401: missing or wrong token
        ├── NotFound ......... 404: no such job/checkpoint (or not yours)
        ├── Conflict ......... 409: the job's state does not allow it
        ├── InvalidSpec ...... 422: the spec has problems; `.problems` lists (field, message)
        ├── QuotaExceeded .... 429: over a quota (max_queued); retry once some jobs started
        └── Unavailable ...... 503: the server's store or broker is down

`APIError` keeps the HTTP `status`, the server's `code`, `message` and `details`.
`is_user_error` tells the CLI whether the fault lies in what the user typed (exit 2).
"""

from __future__ import annotations

from typing import Any


class TorchyardError(Exception):
    """Base of every SDK error."""

    is_user_error = False


class ConnectError(TorchyardError):
    """The server could not be reached."""


class SpecFileError(TorchyardError):
    """A spec file that could not be read or parsed."""

    is_user_error = True


class ConfigError(TorchyardError):
    """The per-user login file exists but cannot be read or is not a login file, or a
    setting is set but empty (TORCHYARD_TOKEN=)."""

    is_user_error = True


class AmbiguousId(TorchyardError):
    """An id prefix that more than one job, sweep or webhook starts with. `matches` holds
    their full ids (jobs and sweeps newest first, webhooks oldest first); the message names
    a few so the user can type more of one."""

    is_user_error = True

    def __init__(self, message: str, matches: list[str]) -> None:
        super().__init__(message)
        self.matches = matches


class ChecksumError(TorchyardError):
    """A downloaded file whose sha256 is not the one the server announced."""


class APIError(TorchyardError):
    """The server answered with an error status."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: Any = None,
        *,
        url: str = "",
        hint: str = "",
    ) -> None:
        self.status = status
        self.code = code
        self.message = message
        self.details = details
        self.url = url
        self.hint = hint  # the client's advice (a 401: where the token was looked for)
        super().__init__(self.one_line())

    @property
    def problems(self) -> list[tuple[str, str]]:
        """`details` as (field, message) pairs, when the server sent that shape."""
        if not isinstance(self.details, list):
            return []
        out = []
        for d in self.details:
            if isinstance(d, dict) and "message" in d:
                out.append((str(d.get("field") or ""), str(d["message"])))
        return out

    def one_line(self) -> str:
        """`422 invalid spec: optimizer.lr: must be > 0; batch_size: must be an integer`."""
        text = f"{self.status} {self.message or self.code}"
        # The server may already list the problems in its message; name each one once.
        every = [f"{f}: {m}" if f else m for f, m in self.problems]
        parts = [p for p in every if p not in text]
        if parts:
            text += ("; " if len(parts) < len(every) else ": ") + "; ".join(parts)
        if self.hint:
            text += f"; {self.hint}"
        return text.replace("\n", " ")


class BadRequest(APIError):
    is_user_error = True


class Unauthorized(APIError):
    pass


class NotFound(APIError):
    pass


class Conflict(APIError):
    pass


class InvalidSpec(APIError):
    is_user_error = True


class QuotaExceeded(APIError):
    """Over a quota: nothing was stored; the same request may succeed later."""


class Unavailable(APIError):
    pass


_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequest,
    401: Unauthorized,
    403: Unauthorized,
    404: NotFound,
    409: Conflict,
    413: BadRequest,
    422: InvalidSpec,
    429: QuotaExceeded,
    503: Unavailable,
}


def error_for(status: int, body: Any, url: str = "", hint: str = "") -> APIError:
    """The APIError for a response, reading `{"error": {"code", "message", "details"}}`
    and falling back to FastAPI's `{"detail": ...}` or the bare status."""
    code, message, details = "http_error", "", None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        code = str(err.get("code") or code)
        message = str(err.get("message") or "")
        details = err.get("details")
    elif isinstance(body, dict) and "detail" in body:
        message = body["detail"] if isinstance(body["detail"], str) else "request refused"
    if not message:
        message = {401: "unauthorized", 404: "not found", 503: "unavailable"}.get(status, "error")
    cls = _BY_STATUS.get(status, APIError)
    return cls(status, code, message, details, url=url, hint=hint)


__all__ = [
    "APIError",
    "AmbiguousId",
    "BadRequest",
    "ChecksumError",
    "ConfigError",
    "Conflict",
    "ConnectError",
    "InvalidSpec",
    "NotFound",
    "QuotaExceeded",
    "SpecFileError",
    "TorchyardError",
    "Unauthorized",
    "Unavailable",
    "error_for",
]
