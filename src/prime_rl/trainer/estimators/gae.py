"""Generalized advantage estimation with a critic (Schulman et al. 2016, "High-Dimensional
Continuous Control Using Generalized Advantage Estimation", arXiv:1506.02438), PPO's estimator:

    delta_t = r_t + gamma V(s_{t+1}) - V(s_t),   A_t = sum_k (gamma lam)^k delta_{t+k},   R_t = A_t + V(s_t)

over the sample's model tokens; the terminal reward is the rollout's reward (not the orchestrator's
advantage), plus the KL-in-reward penalty on every model token. The critic (`[trainer.critic]`)
regresses on R_t.
"""

from __future__ import annotations

from prime_rl.trainer.estimators.base import (
    TokenAdvantageError,
    TokenAdvantageInputs,
    TokenAdvantageOutputs,
)
from prime_rl.trainer.estimators.returns import gae, terminal_rewards


def gae_estimator(
    inputs: TokenAdvantageInputs, gamma: float = 1.0, lam: float = 0.95
) -> TokenAdvantageOutputs:
    if inputs.values is None:
        raise TokenAdvantageError("advantage.type = 'gae' needs the critic's values")
    grid = inputs.grid
    rewards = terminal_rewards(grid, inputs.rollout_rewards) + inputs.kl_rewards
    advantages, returns = gae(grid, rewards, inputs.values, gamma, lam)
    return TokenAdvantageOutputs(advantages, returns)
