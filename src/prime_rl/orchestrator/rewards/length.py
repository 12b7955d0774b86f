"""DAPO's soft overlong punishment (Yu et al. 2025, "DAPO", arXiv:2503.14476, "Overlong Reward
Shaping"), on the tokens the model generated in the rollout (L = max_tokens, C = buffer, |y| =
completion tokens):

    R(y) = 0                      if |y| <= L - C
         = ((L - C) - |y|) / C    if L - C < |y| <= L
         = -1                     if |y| > L

Added to the env's reward (weight 1 in the paper), it tells the policy that running into the length
limit is bad before truncation throws the answer away.

Invariant: the length is counted from the token ids the model sampled (the trace's token graph,
summed over the rollout's turns), the same ids the trainer trains on.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from prime_rl.config.plugins import Builtin
from prime_rl.orchestrator.rewards.base import RewardBase


class LengthReward(RewardBase):
    """A penalty on completions close to or over a token budget: 0 up to `max_tokens - buffer`
    completion tokens, falling linearly to -1 at `max_tokens`."""

    type: Literal["length"]
    """Selects this reward function."""

    max_tokens: int = Field(ge=1)
    """The budget L: completion tokens (all turns) at which the penalty reaches -1; usually the
    env's `sampling.max_tokens` for a single-turn env."""

    buffer: int = Field(ge=1)
    """The length C of the soft zone before `max_tokens` where the penalty grows from 0 to -1."""

    @model_validator(mode="after")
    def _buffer_fits(self):
        if self.buffer > self.max_tokens:
            raise ValueError(f"buffer = {self.buffer} must be at most max_tokens = {self.max_tokens}")
        return self


def length(trace: Any, max_tokens: int, buffer: int) -> float:
    n = trace.num_output_tokens  # the sampled tokens of every turn, from the trace's token graph
    soft_start = max_tokens - buffer
    if n <= soft_start:
        return 0.0
    if n > max_tokens:
        return -1.0
    return (soft_start - n) / buffer


BUILTIN = Builtin("length", length, LengthReward)
