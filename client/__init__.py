"""torchyard's Python SDK and CLI client. HTTP only: nothing here imports server code."""

from torchyard.client.config import DEFAULT_URL
from torchyard.client.errors import (
    AmbiguousId,
    APIError,
    BadRequest,
    ChecksumError,
    ConfigError,
    Conflict,
    ConnectError,
    InvalidSpec,
    NotFound,
    QuotaExceeded,
    SpecFileError,
    TorchyardError,
    Unauthorized,
    Unavailable,
)
from torchyard.client.sdk import (
    TERMINAL_STATES,
    Client,
    Download,
    Event,
    load_spec,
    resolve_config,
)

__all__ = [
    "DEFAULT_URL",
    "TERMINAL_STATES",
    "APIError",
    "AmbiguousId",
    "BadRequest",
    "ChecksumError",
    "Client",
    "ConfigError",
    "Conflict",
    "ConnectError",
    "Download",
    "Event",
    "InvalidSpec",
    "NotFound",
    "QuotaExceeded",
    "SpecFileError",
    "TorchyardError",
    "Unauthorized",
    "Unavailable",
    "load_spec",
    "resolve_config",
]
