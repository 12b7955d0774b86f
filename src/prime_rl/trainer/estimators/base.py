"""What every token-level advantage estimator shares: its inputs and outputs, its config's common
fields, and the check of what it returns (`Estimator`).

Contract: `fn(TokenAdvantageInputs, **kwargs) -> TokenAdvantageOutputs`, for one packed micro-batch.
This is the second kind of estimator: the first, per-rollout `advantage_fn -> list[float]`, runs in
the orchestrator, and `reinforce` with gamma = 1 hands its output through unchanged.

Invariant: advantages and returns are finite, of shape [T], and 0 outside the loss mask; an
estimator that breaks this raises `TokenAdvantageError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from prime_rl.trainer.estimators.config import ESTIMATORS, EstimatorBase
from prime_rl.trainer.estimators.returns import TokenGrid


@dataclass(frozen=True)
class TokenAdvantageInputs:
    """One micro-batch, per token ([T] tensors) unless said otherwise."""

    loss_mask: torch.Tensor
    """Bool: the model tokens."""
    sample_lens: list[int]
    rollout_advantages: torch.Tensor
    """The orchestrator's per-rollout advantage, on every token of the sample."""
    rollout_rewards: torch.Tensor
    """[samples]: each sample's rollout reward."""
    kl_rewards: torch.Tensor
    """-beta * KL_t on model tokens (all 0 without KL in the reward)."""
    kl_in_reward: bool | None = None
    """Whether `kl_rewards` can be non-zero; the trainer says so, which spares reading the tensor
    on the host (a GPU sync). None: look at the tensor."""
    values: torch.Tensor | None = None
    """The critic's value of each model token's state, when a critic is configured."""

    @property
    def grid(self) -> TokenGrid:
        return TokenGrid.of(self.loss_mask, self.sample_lens)


@dataclass(frozen=True)
class TokenAdvantageOutputs:
    advantages: torch.Tensor
    returns: torch.Tensor | None = None
    """The critic's regression targets (required when a critic trains)."""


class TokenAdvantageError(ValueError):
    """A token-level estimator returned something unusable."""


@dataclass(frozen=True)
class Estimator:
    """A configured token-level estimator, validated on every call."""

    name: str
    fn: Callable[..., TokenAdvantageOutputs]
    kwargs: dict[str, Any]

    def __call__(
        self, inputs: TokenAdvantageInputs, host: Callable[[torch.Tensor], object] = torch.Tensor.tolist
    ) -> TokenAdvantageOutputs:
        """`host` copies the finiteness check to the host (the trainer's `World.host`)."""
        out = self.fn(inputs, **self.kwargs)
        where = f"token-level advantage estimator '{self.name}'"
        if not isinstance(out, TokenAdvantageOutputs):
            raise TokenAdvantageError(
                f"{where} returned {type(out).__name__}, expected TokenAdvantageOutputs"
            )
        shape = inputs.loss_mask.shape
        for field, t in (("advantages", out.advantages), ("returns", out.returns)):
            if t is None:
                continue
            if t.shape != shape:
                raise TokenAdvantageError(
                    f"{where} returned {field} of shape {tuple(t.shape)}, expected {tuple(shape)}"
                )
            if not host(torch.isfinite(t).all()):
                raise TokenAdvantageError(f"{where} returned non-finite {field}")
        mask = inputs.loss_mask
        returns = None if out.returns is None else out.returns.float() * mask
        return TokenAdvantageOutputs(out.advantages.float() * mask, returns)


def build_estimator(config: EstimatorBase, key: str = "trainer.advantage") -> Estimator:
    """The configured estimator, validated on every call; a built-in's function is imported here."""
    found = ESTIMATORS.resolve(config, key)
    return Estimator(found.name, found.fn, found.kwargs)
