"""Reward functions added to an env's rubric (`[[orchestrator.envs.rewards]]`): one module per
built-in (its function and its config), listed once below. The env side binds and attaches them
(`orchestrator/envs/env_rewards.py`).

Adding a built-in: write `rewards/<name>.py` with a config subclassing `RewardBase` (`type:
Literal["<name>"]`) and `<name>(<rubric arguments it names>, **its fields) -> float`, ending with
`BUILTIN = Builtin("<name>", <name>, <Config>)`; add it to `REWARDS`.

Invariant: config and plain functions only (no env side, no model loaded at import), so that the
orchestrator's config and preflight can import this package.
"""

from __future__ import annotations

from prime_rl.config.plugins import Registry
from prime_rl.orchestrator.rewards import length, reward_model
from prime_rl.orchestrator.rewards.base import CustomReward, RewardBase, bind, unknown_kwargs

REWARDS = Registry("reward function", RewardBase, CustomReward, [
    reward_model.BUILTIN,
    length.BUILTIN,
])  # fmt: skip

RewardConfig = REWARDS.config_type()

__all__ = ["REWARDS", "CustomReward", "RewardBase", "RewardConfig", "bind", "unknown_kwargs"]
