"""The reward functions an env's config adds to its scoring (`[[orchestrator.envs.rewards]]`),
built once, when the env is loaded.

Each entry becomes one scoring hook (`scoring.Hook`) with its weight: a built-in with its fields
bound, a user's function with its `kwargs` bound (`rewards.bind`, which keeps the signature the
scorer selects arguments by), a reward model bound to the one batcher its path or URL has in this
process. A reward model's `env_reward_weight` scales the env's own rewards, never the added ones.

Invariant: an entry that cannot be built (a function that does not load or does not take its
kwargs, a name already taken, a reward model that does not load) is an `EnvError` naming the
entry's key; otherwise the scorer gains exactly one hook per entry.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from prime_rl.config.plugins import PluginError
from prime_rl.environments import EnvError
from prime_rl.model.reward import RewardModelError
from prime_rl.orchestrator.envs.reward_model import RewardModels, reward_function
from prime_rl.orchestrator.envs.rewards import RewardRunner
from prime_rl.orchestrator.envs.scoring import Hook, Scorer
from prime_rl.orchestrator.rewards import REWARDS, RewardBase, bind, unknown_kwargs
from prime_rl.orchestrator.rewards.reward_model import RewardModelReward


def build_reward(config: RewardBase, key: str, models: RewardModels | None) -> Callable[..., Any] | None:
    """The function of one entry, named and bound; None for a reward model without `models` (a
    process that only serves tasks scores nothing)."""
    if isinstance(config, RewardModelReward):
        if models is None:
            return None
        return reward_function(models.batcher(config, key), config.name or "reward_model")
    found = REWARDS.resolve(config, key)
    unknown = unknown_kwargs(found.fn, found.kwargs)
    if unknown:
        raise PluginError(f"{key}.kwargs: function '{found.name}' takes no argument(s) {unknown}")
    return bind(found.fn, found.kwargs, config.name or getattr(found.fn, "__name__", found.name))


def make_scorer(
    configs: Sequence[RewardBase], key: str, runner: RewardRunner, models: RewardModels | None, own: set[str]
) -> Scorer:
    """The env's scorer with its `rewards` added; `key` names the list, e.g. 'envs[0].rewards';
    `own` are the names of the env's own rewards and metrics (an added one may not reuse them)."""
    scale = math.prod(c.env_reward_weight for c in configs if isinstance(c, RewardModelReward))
    names, hooks = set(own), []
    for i, config in enumerate(configs):
        where = f"{key}[{i}]"
        try:
            fn = build_reward(config, where, models)
        except (PluginError, RewardModelError) as e:
            raise EnvError(str(e)) from None
        if fn is None:
            continue
        if fn.__name__ in names:
            raise EnvError(
                f"{where}: the env already has a reward or metric named '{fn.__name__}', whose value "
                f"this one would overwrite: give it another {where}.name"
            )
        names.add(fn.__name__)
        hooks.append(Hook(fn, fn.__name__, "reward", config.weight))
    return Scorer(runner, hooks, scale)
