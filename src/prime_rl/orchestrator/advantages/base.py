"""What every advantage function shares: its inputs and outputs, its config's common part, and the
check of what it returns (`Advantage`).

Contract: `advantage_fn(AdvantageInputs, **kwargs) -> AdvantageOutputs`, where `inputs.rollouts` is
one group (the surviving rollouts of one (env_name, example_id)) and `outputs.advantages` has one
finite float per rollout, in the same order.

Invariant: an advantage that reaches training was validated here; a wrong length, NaN or inf raises
`AdvantageError` naming the env, the example and the function. A singleton group gets 0.0 without
calling the function (no baseline exists for it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prime_rl.config import BaseConfig
from prime_rl.orchestrator.rollout import Rollout

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


class AdvantageError(ValueError):
    """An advantage function returned something unusable, or could not be loaded."""


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def std(xs: list[float]) -> float:
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))


class AdvantageBase(BaseConfig):
    """What every advantage function's config shares."""

    moved_keys: ClassVar[dict[str, str]] = {
        "batch_normalize": "normalization happens once, in the trainer, after its estimator: set "
        "trainer.advantage.batch_normalize instead",
        "import_path": "name your function in 'type' = 'package.module:function'",
    }

    @property
    def expects_batch_normalization(self) -> bool:
        """Whether the method is defined with the trainer's batch whitening after it (the
        trainer's `advantage.batch_normalize`, checked at start-up by the run contract)."""
        return False


class CustomAdvantage(AdvantageBase):
    """Your own function: `fn(AdvantageInputs, **kwargs) -> AdvantageOutputs`."""

    type: str
    """Where the function lives, as 'package.module:function'."""

    kwargs: dict[str, Any] = {}
    """Keyword arguments passed to the function on every call."""


@dataclass(frozen=True)
class Advantage:
    """A configured advantage function, validated on every call."""

    name: str
    fn: Callable[..., AdvantageOutputs]
    kwargs: dict[str, Any]

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
