"""A pickle-free encoding for the small structured values ranks exchange (RNG states).

torch.distributed's `*_object*` collectives pickle what a rank sends and unpickle what it
receives: a peer (or whoever can reach the rendezvous port) could make every rank run code.
This encoding carries JSON for the structure and raw bytes for tensors, so decoding builds
only JSON types and tensors of a known dtype, whatever the bytes say.

Layout: 8 bytes (little-endian header length), the header (UTF-8 JSON of the value, each
tensor replaced by `{"__tensor__": [dtype, shape, offset, nbytes]}`), then the tensors' bytes.
Tuples come back as lists; dict keys must be strings.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

TENSOR_KEY = "__tensor__"
_DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
    )
}
_HEAD = 8


class WireError(ValueError):
    """Bytes that are not a valid encoding (truncated, unknown dtype, bad offsets)."""


def encode(value: Any) -> bytes:
    """`value` (JSON types, nested dicts/lists/tuples, CPU or device tensors) as bytes."""
    chunks: list[bytes] = []
    offset = 0

    def walk(v: Any) -> Any:
        nonlocal offset
        if isinstance(v, torch.Tensor):
            name = str(v.dtype).removeprefix("torch.")
            if name not in _DTYPES:
                raise TypeError(f"tensor dtype {v.dtype} cannot be encoded")
            t = v.detach().cpu().contiguous().reshape(-1)
            raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
            chunks.append(raw)
            offset += len(raw)
            return {TENSOR_KEY: [name, list(v.shape), offset - len(raw), len(raw)]}
        if isinstance(v, dict):
            if TENSOR_KEY in v or not all(isinstance(k, str) for k in v):
                raise TypeError(f"dict keys must be strings other than {TENSOR_KEY!r}")
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [walk(x) for x in v]
        if v is None or isinstance(v, bool | int | float | str):
            return v
        raise TypeError(f"{type(v).__name__} cannot be encoded (JSON types and tensors only)")

    header = json.dumps(walk(value), separators=(",", ":")).encode()
    return len(header).to_bytes(_HEAD, "little") + header + b"".join(chunks)


def _split(data: bytes) -> tuple[Any, memoryview]:
    """The JSON header and the tensor data after it."""
    if len(data) < _HEAD:
        raise WireError("truncated: no header length")
    n = int.from_bytes(data[:_HEAD], "little")
    if n > len(data) - _HEAD:
        raise WireError(f"truncated: header of {n} bytes, {len(data) - _HEAD} present")
    try:
        tree = json.loads(data[_HEAD : _HEAD + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"header is not JSON: {e}") from None
    return tree, memoryview(data)[_HEAD + n :]


def decode(data: bytes) -> Any:
    """The value `encode` was given (tensors on the CPU); WireError on malformed bytes."""
    tree, body = _split(data)

    def tensor(spec: Any) -> torch.Tensor:
        if not (isinstance(spec, list) and len(spec) == 4):
            raise WireError(f"bad tensor entry {spec!r}")
        name, shape, off, nbytes = spec
        dtype = _DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise WireError(f"dtype {name!r} is not allowed")
        ints = [*shape, off, nbytes] if isinstance(shape, list) else None
        if ints is None or not all(type(i) is int and i >= 0 for i in ints):
            raise WireError(f"bad tensor entry {spec!r}")
        if nbytes != math.prod(shape) * dtype.itemsize or off + nbytes > len(body):
            raise WireError(f"tensor entry {spec!r} does not fit {len(body)} bytes of data")
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(bytearray(body[off : off + nbytes]), dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            if TENSOR_KEY in v:
                return tensor(v[TENSOR_KEY])
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    return walk(tree)
