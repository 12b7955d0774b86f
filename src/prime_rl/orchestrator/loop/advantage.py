"""Advantage functions: called once per group, they return one float per rollout.

Contract: `advantage_fn(AdvantageInputs, **kwargs) -> AdvantageOutputs`, where `inputs.rollouts` is
one group (the surviving rollouts of one (env_name, example_id)) and `outputs.advantages` has one
finite float per rollout, in the same order. Built-ins: `grpo`, `rloo`, `reinforce_baseline`;
custom functions are named by import path in the config.

Invariant: an advantage that reaches training was validated here; a wrong length, NaN or inf raises
`AdvantageError` naming the env, the example and the function. A singleton group gets 0.0 without
calling the function (no baseline exists for it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prime_rl.orchestrator.config import AdvantageConfig, CustomAdvantage, GRPOAdvantage
from prime_rl.orchestrator.rollout import Rollout
from prime_rl.plugins import PluginError, load_function

STD_EPS = 1e-6


@dataclass
class AdvantageInputs:
    """What an advantage function sees: one group."""

    rollouts: list[Rollout]
    env_name: str
    example_id: int | str

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]


@dataclass
class AdvantageOutputs:
    """What an advantage function returns: one advantage per rollout, in order."""

    advantages: list[float]
    metrics: dict[str, float] = field(default_factory=dict)


AdvantageFn = Callable[..., AdvantageOutputs]


class AdvantageError(ValueError):
    """An advantage function returned something unusable, or could not be loaded."""


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _std(xs: list[float]) -> float:
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


def grpo(inputs: AdvantageInputs, std_normalize: bool = False) -> AdvantageOutputs:
    """Reward minus the group mean; optionally divided by the group std."""
    rewards = inputs.rewards
    mean = _mean(rewards)
    adv = [r - mean for r in rewards]
    if std_normalize:
        std = _std(rewards)
        adv = [a / (std + STD_EPS) for a in adv]
    return AdvantageOutputs(adv)


def rloo(inputs: AdvantageInputs) -> AdvantageOutputs:
    """Reward minus the mean reward of the other rollouts of the group."""
    rewards = inputs.rewards
    n, total = len(rewards), sum(rewards)
    return AdvantageOutputs([r - (total - r) / (n - 1) for r in rewards])


def reinforce_baseline(inputs: AdvantageInputs) -> AdvantageOutputs:
    """Group-mean baseline; its batch whitening (`batch_normalize = "all"`) happens once the step's
    batch is known."""
    return grpo(inputs)


BUILTINS: dict[str, AdvantageFn] = {"grpo": grpo, "rloo": rloo, "reinforce_baseline": reinforce_baseline}


@dataclass
class Advantage:
    """A configured advantage function, validated on every call."""

    name: str
    fn: AdvantageFn
    kwargs: dict[str, Any]
    batch_normalize: str = "none"
    """'none', 'all' or 'env': how the step's trained advantages are whitened (`batch_whiten`)."""

    @classmethod
    def from_config(cls, config: AdvantageConfig | None) -> Advantage:
        config = config or GRPOAdvantage()
        if isinstance(config, CustomAdvantage):
            try:
                fn = load_function(config.import_path, key="advantage import_path")
            except PluginError as e:
                raise AdvantageError(str(e)) from None
            return cls(config.import_path, fn, dict(config.kwargs), config.batch_normalize)
        kwargs = config.model_dump(exclude={"type", "batch_normalize"})
        return cls(config.type, BUILTINS[config.type], kwargs, config.batch_normalize)

    def __call__(self, inputs: AdvantageInputs) -> AdvantageOutputs:
        where = f"advantage function '{self.name}' on env '{inputs.env_name}', example {inputs.example_id!r}"
        n = len(inputs.rollouts)
        if n == 1:
            return AdvantageOutputs([0.0])
        try:
            out = self.fn(inputs, **self.kwargs)
        except Exception as e:
            raise AdvantageError(f"{where} raised {type(e).__name__}: {e}") from e
        advantages = out.advantages if isinstance(out, AdvantageOutputs) else None
        if advantages is None:
            raise AdvantageError(f"{where} returned {type(out).__name__}, expected AdvantageOutputs")
        if len(advantages) != n:
            raise AdvantageError(f"{where} returned {len(advantages)} advantages for a group of {n} rollouts")
        try:
            values = [float(a) for a in advantages]
        except (TypeError, ValueError):
            raise AdvantageError(f"{where} returned a non-number among {advantages!r}") from None
        bad = [i for i, a in enumerate(values) if not math.isfinite(a)]
        if bad:
            raise AdvantageError(f"{where} returned non-finite advantages at positions {bad}: {values}")
        return AdvantageOutputs(values, dict(out.metrics))


def batch_whiten(advantages: list[float]) -> list[float]:
    """(a - mean) / (std + eps) over one pool of a step's trained advantages."""
    if len(advantages) < 2:
        return advantages
    mean, std = _mean(advantages), _std(advantages)
    return [(a - mean) / (std + STD_EPS) for a in advantages]
