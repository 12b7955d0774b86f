"""What one model call samples with and what it returns, shared by vLLM's engine in the
orchestrator's process (`local.py`) and the orchestrator's server client (`envs/sampler.py`).

Invariant: a `Completion` has one logprob per token id, and its `finish_reason` is 'stop' or
'length' whatever the backend calls it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class BadRequestError(ValueError):
    """The request was refused (a 4xx, an invalid sampling argument, a prompt longer than the
    model's context): retrying it cannot help."""


@dataclass(frozen=True)
class SamplingArgs:
    """What a model call samples with (an env's `[envs.sampling]`, salted per policy version)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None
    cache_salt: str | None = None
    """A server keeps its prefix cache across weight reloads (for requests in flight); salting by
    policy version keeps a new request from reusing a prefix computed by older weights."""
    extra: dict[str, Any] = field(default_factory=dict)
    """vLLM sampling fields beyond these (e.g. `min_tokens`, `stop`), as the env's `extra_body`."""


@dataclass(frozen=True)
class Completion:
    """One sampled completion."""

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    """'stop' (end of sequence or a stop string) or 'length' (`max_tokens`, the context)."""
    version: int | None = None
    """The policy version the server held when the completion finished (None: not known)."""
    routes: Any = None
    """A MoE server's routed experts over prompt + completion ([tokens, layers, top-k]), or None."""
