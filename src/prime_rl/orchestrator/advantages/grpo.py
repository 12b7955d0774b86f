"""GRPO's group-relative advantage (Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300):

    A_i = (r_i - mean(r)) / (std(r) + eps)   (the division only with `std_normalize`)

Without the division it is Dr. GRPO's (Liu et al. 2025, arXiv:2503.20783), the default. The std is
the population one (divided by n); `std_unbiased` takes Bessel's (n - 1), as verl and TRL do.
"""

from __future__ import annotations

import math
from typing import Literal

from prime_rl.config.plugins import Builtin
from prime_rl.orchestrator.advantages.base import (
    STD_EPS,
    AdvantageBase,
    AdvantageInputs,
    AdvantageOutputs,
    mean,
    std,
)


class GRPOAdvantage(AdvantageBase):
    """Reward minus the group mean, optionally divided by the group std."""

    type: Literal["grpo"] = "grpo"
    """Selects this advantage function."""

    std_normalize: bool = False
    """Divide by the group's reward std (plus a small epsilon)."""

    std_unbiased: bool = False
    """With `std_normalize`: Bessel's std (divided by n - 1, as verl and TRL), not the population
    std (divided by n). A group of one has std 0 either way."""


def grpo(
    inputs: AdvantageInputs, std_normalize: bool = False, std_unbiased: bool = False
) -> AdvantageOutputs:
    rewards = inputs.rewards
    m = mean(rewards)
    adv = [r - m for r in rewards]
    if std_normalize:
        n = len(rewards)
        s = std(rewards) * (math.sqrt(n / (n - 1)) if std_unbiased and n > 1 else 1.0)
        adv = [a / (s + STD_EPS) for a in adv]
    return AdvantageOutputs(adv)


BUILTIN = Builtin("grpo", grpo, GRPOAdvantage)
