"""torchyard's Python SDK and CLI client. HTTP only: nothing here imports server code."""

from torchyard.client.errors import (
    APIError,
    BadRequest,
    ChecksumError,
    Conflict,
    ConnectError,
    InvalidSpec,
    NotFound,
    SpecFileError,
    TorchyardError,
    Unauthorized,
    Unavailable,
)
from torchyard.client.sdk import (
    DEFAULT_URL,
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
    "BadRequest",
    "ChecksumError",
    "Client",
    "Conflict",
    "ConnectError",
    "Download",
    "Event",
    "InvalidSpec",
    "NotFound",
    "SpecFileError",
    "TorchyardError",
    "Unauthorized",
    "Unavailable",
    "load_spec",
    "resolve_config",
]
