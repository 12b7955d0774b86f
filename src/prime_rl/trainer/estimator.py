"""Token-level advantage estimators: per-token advantages (and returns) from each sample's reward.

Contract: `fn(TokenAdvantageInputs, **kwargs) -> TokenAdvantageOutputs`, for one packed micro-batch.
Built-ins: `reinforce` (discounted returns of the per-token reward) and `gae` (with the critic's
values); a custom one is named by import path in `[trainer.advantage]`. This is the second kind of
estimator: the first, per-rollout `advantage_fn -> list[float]`, runs in the orchestrator, and
`reinforce` with gamma = 1 hands its output through unchanged.

Invariant: advantages and returns are finite, of shape [T], and 0 outside the loss mask; a custom
estimator that breaks this raises `TokenAdvantageError` naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from prime_rl.plugins import load_function
from prime_rl.trainer.config import TokenAdvantageConfig
from prime_rl.trainer.returns import TokenGrid, discounted_returns, gae, terminal_rewards


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


def reinforce(inputs: TokenAdvantageInputs, gamma: float = 1.0) -> TokenAdvantageOutputs:
    mask = inputs.loss_mask
    kl = inputs.kl_in_reward if inputs.kl_in_reward is not None else bool(inputs.kl_rewards.any())
    if gamma == 1.0 and not kl:
        return TokenAdvantageOutputs(inputs.rollout_advantages * mask)  # the common case, exactly
    grid = inputs.grid
    # The rollout advantage, constant over the sample, is its terminal reward: discounted too.
    rewards = torch.where(grid.last_token(), inputs.rollout_advantages.float(), 0.0) + inputs.kl_rewards
    return TokenAdvantageOutputs(discounted_returns(grid, rewards, gamma))


def gae_estimator(
    inputs: TokenAdvantageInputs, gamma: float = 1.0, lam: float = 0.95
) -> TokenAdvantageOutputs:
    if inputs.values is None:
        raise TokenAdvantageError("advantage.type = 'gae' needs the critic's values")
    grid = inputs.grid
    rewards = terminal_rewards(grid, inputs.rollout_rewards) + inputs.kl_rewards
    advantages, returns = gae(grid, rewards, inputs.values, gamma, lam)
    return TokenAdvantageOutputs(advantages, returns)


TokenAdvantageFn = Callable[..., TokenAdvantageOutputs]


@dataclass(frozen=True)
class TokenEstimator:
    """A configured token-level estimator, validated on every call."""

    name: str
    fn: TokenAdvantageFn
    kwargs: dict

    @classmethod
    def from_config(cls, config: TokenAdvantageConfig) -> TokenEstimator:
        if config.type == "custom":
            fn = load_function(config.import_path, key="trainer.advantage.import_path")
            return cls(config.import_path, fn, dict(config.kwargs))
        if config.type == "gae":
            return cls("gae", gae_estimator, {"gamma": config.gamma, "lam": config.lam})
        return cls("reinforce", reinforce, {"gamma": config.gamma})

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
