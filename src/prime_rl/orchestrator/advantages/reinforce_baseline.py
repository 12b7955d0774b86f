"""REINFORCE++-baseline (Hu et al. 2025, "REINFORCE++", arXiv:2501.03262): reward minus the group
mean here, then whitened over the step's batch of tokens by the trainer, which is where the run's
one normalization happens (`trainer.advantage.batch_normalize = "all"`; the run contract checks at
start-up that the trainer does it).
"""

from __future__ import annotations

from typing import Literal

from prime_rl.config.plugins import Builtin
from prime_rl.orchestrator.advantages.base import AdvantageBase, AdvantageInputs, AdvantageOutputs
from prime_rl.orchestrator.advantages.grpo import grpo


class ReinforceBaselineAdvantage(AdvantageBase):
    """Reward minus the group mean, then whitened over the step's batch (in the trainer)."""

    type: Literal["reinforce_baseline"] = "reinforce_baseline"
    """Selects this advantage function."""

    @property
    def expects_batch_normalization(self) -> bool:
        return True


def reinforce_baseline(inputs: AdvantageInputs) -> AdvantageOutputs:
    return grpo(inputs)


BUILTIN = Builtin("reinforce_baseline", reinforce_baseline, ReinforceBaselineAdvantage)
