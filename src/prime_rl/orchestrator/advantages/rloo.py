"""REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740):

A_i = r_i - mean of the other rollouts' rewards
"""

from __future__ import annotations

from typing import Literal

from prime_rl.config.plugins import Builtin
from prime_rl.orchestrator.advantages.base import AdvantageBase, AdvantageInputs, AdvantageOutputs


class RLOOAdvantage(AdvantageBase):
    """Reward minus the mean of the other rollouts of the group (leave-one-out baseline)."""

    type: Literal["rloo"] = "rloo"
    """Selects this advantage function."""


def rloo(inputs: AdvantageInputs) -> AdvantageOutputs:
    rewards = inputs.rewards
    n, total = len(rewards), sum(rewards)
    return AdvantageOutputs([r - (total - r) / (n - 1) for r in rewards])


BUILTIN = Builtin("rloo", rloo, RLOOAdvantage)
