"""REINFORCE with discounted returns of the per-token reward (the default):

    A_t = sum over the sample's later model tokens k >= t of gamma^(k - t) r_k

where r is the KL-in-reward penalty on every model token plus, on the last model token, the
orchestrator's per-rollout advantage. With gamma = 1 and no KL in the reward this is that advantage
on every token, exactly as the orchestrator computed it. Environment tokens (loss mask 0) carry no
reward and are skipped: the discount counts model tokens only.
"""

from __future__ import annotations

import torch

from prime_rl.trainer.estimators.base import TokenAdvantageInputs, TokenAdvantageOutputs
from prime_rl.trainer.estimators.returns import discounted_returns


def reinforce(inputs: TokenAdvantageInputs, gamma: float = 1.0) -> TokenAdvantageOutputs:
    mask = inputs.loss_mask
    kl = inputs.kl_in_reward if inputs.kl_in_reward is not None else bool(inputs.kl_rewards.any())
    if gamma == 1.0 and not kl:
        return TokenAdvantageOutputs(inputs.rollout_advantages * mask)  # the common case, exactly
    grid = inputs.grid
    # The rollout advantage, constant over the sample, is its terminal reward: discounted too.
    rewards = torch.where(grid.last_token(), inputs.rollout_advantages.float(), 0.0) + inputs.kl_rewards
    return TokenAdvantageOutputs(discounted_returns(grid, rewards, gamma))
