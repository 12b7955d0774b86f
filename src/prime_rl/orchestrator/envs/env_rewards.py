"""The reward functions an env's config adds to its rubric (`[[orchestrator.envs.rewards]]`),
attached once, when the env is loaded.

Each entry becomes one function of the env's rubric, with its weight: a built-in with its fields
bound, a user's function with its `kwargs` bound (both through `rewards.bind`, which keeps verifiers'
argument matching), a reward model bound to the one batcher its path or URL has in this process. A
reward model's `env_reward_weight` scales the env's own functions, never the added ones.

Invariant: an entry that cannot join the rubric (a verifiers.v1 env, a function that does not load
or does not take its kwargs, a name the rubric already has, a reward model that does not load) is an
`EnvError` naming the entry's key; otherwise the rubric gains exactly one function per entry, run by
the `RewardRunner` like the env's own (timeout, failure recorded so the rollout fails).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from prime_rl.environments import EnvError
from prime_rl.model.reward import RewardModelError
from prime_rl.orchestrator.envs.reward_model import RewardModels, reward_function
from prime_rl.orchestrator.envs.rewards import RewardRunner, rubrics
from prime_rl.orchestrator.rewards import REWARDS, RewardBase, bind, unknown_kwargs
from prime_rl.orchestrator.rewards.reward_model import RewardModelReward
from prime_rl.plugins import PluginError


def build_reward(config: RewardBase, key: str, models: RewardModels | None) -> Callable[..., Any] | None:
    """The rubric function of one entry, named and bound; None for a reward model without `models`
    (a process that only serves datasets scores nothing)."""
    if isinstance(config, RewardModelReward):
        if models is None:
            return None
        return reward_function(models.batcher(config, key), config.name or "reward_model")
    found = REWARDS.resolve(config, key)
    unknown = unknown_kwargs(found.fn, found.kwargs)
    if unknown:
        raise PluginError(f"{key}.kwargs: function '{found.name}' takes no argument(s) {unknown}")
    return bind(found.fn, found.kwargs, config.name or getattr(found.fn, "__name__", found.name))


def attach_rewards(
    vf_env,
    configs: Sequence[RewardBase],
    key: str,
    runner: RewardRunner | None = None,
    models: RewardModels | None = None,
) -> None:
    """Add the env's `rewards` to its rubric, in place; `key` names the list, e.g. 'envs[0].rewards'."""
    if not configs:
        return
    rubric = getattr(vf_env, "rubric", None)
    if rubric is None or not hasattr(rubric, "add_reward_func"):
        raise EnvError(
            f"{key}: reward functions need a classic verifiers env with a rubric (not a verifiers.v1 env)"
        )
    scale = math.prod(c.env_reward_weight for c in configs if isinstance(c, RewardModelReward))
    if scale != 1.0:
        for r in rubrics(rubric):
            if isinstance(getattr(r, "weights", None), list):
                r.weights[:] = [w * scale for w in r.weights]
    names = {getattr(f, "__name__", None) for r in rubrics(rubric) for f in getattr(r, "funcs", None) or []}
    is_group = getattr(rubric, "_is_group_func", None)
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
                f"{where}: the env's rubric already has a function named '{fn.__name__}', whose metric "
                f"this one would overwrite: give it another {where}.name"
            )
        names.add(fn.__name__)
        if runner is not None:
            fn = runner.wrap(fn, is_group(fn) if is_group else None)
        rubric.add_reward_func(fn, config.weight)
