"""Advantage functions: called once per group, they return one float per rollout. One module per
built-in (its function and its config), listed once below.

Adding a built-in: write `advantages/<name>.py` with a config subclassing `AdvantageBase` (`type:
Literal["<name>"]`) and `<name>(inputs: AdvantageInputs, **its fields) -> AdvantageOutputs`, ending
with `BUILTIN = Builtin("<name>", <name>, <Config>)`; add it to `ADVANTAGES`.
"""

from __future__ import annotations

from prime_rl.config.plugins import PluginError, Registry
from prime_rl.orchestrator.advantages import grpo, reinforce_baseline, rloo
from prime_rl.orchestrator.advantages.base import (
    Advantage,
    AdvantageBase,
    AdvantageError,
    AdvantageInputs,
    AdvantageOutputs,
    CustomAdvantage,
)

ADVANTAGES = Registry("advantage function", AdvantageBase, CustomAdvantage, [
    grpo.BUILTIN,
    rloo.BUILTIN,
    reinforce_baseline.BUILTIN,
])  # fmt: skip

AdvantageConfig = ADVANTAGES.config_type()


def build_advantage(config: AdvantageBase, key: str = "orchestrator.advantage") -> Advantage:
    try:
        found = ADVANTAGES.resolve(config, key)
    except PluginError as e:
        raise AdvantageError(str(e)) from None
    return Advantage(found.name, found.fn, found.kwargs)


__all__ = [
    "ADVANTAGES",
    "Advantage",
    "AdvantageConfig",
    "AdvantageError",
    "AdvantageInputs",
    "AdvantageOutputs",
    "build_advantage",
]
