"""Decode the routed experts a MoE server returns with a completion.

Invariant: whatever the encoding, a decoded route table is a numpy array [rows, layers, top-k] of
unsigned expert ids with the prompt position of its first row; anything else is a ValueError that
says what arrived. Two encodings exist: vLLM's chat response carries `routed_experts` as base64 of
an `.npy` file (always from the first prompt token); verifiers' sidecar (for servers that stream it
apart from the JSON) is a dict of base64 `data`, `shape`, `dtype` and `start`.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np


def decode_routes(payload: Any) -> tuple[np.ndarray, int] | None:
    """(routes [rows, layers, top-k], position of row 0), or None when no routes came."""
    if payload is None:
        return None
    if isinstance(payload, np.ndarray):
        routes, start = payload, 0
    elif isinstance(payload, str | bytes | memoryview):
        routes, start = np.load(io.BytesIO(_b64(payload)), allow_pickle=False), 0
    elif isinstance(payload, dict) and {"data", "shape"} <= payload.keys():
        raw = _b64(payload["data"])
        dtype = np.dtype(payload.get("dtype") or "int32")
        routes = np.frombuffer(raw, dtype=dtype).reshape(payload["shape"])
        start = int(payload.get("start") or 0)
    else:
        raise ValueError(f"routed experts of an unknown encoding: {type(payload).__name__}")
    if routes.ndim != 3 or routes.dtype.kind not in "iu":
        raise ValueError(
            f"routed experts must be integer [tokens, layers, top-k], got {routes.dtype} {routes.shape}"
        )
    return routes, start


def _b64(data: str | bytes | memoryview) -> bytes:
    return base64.b64decode(data if isinstance(data, str) else bytes(data))
