"""Custom advantage functions for tests: one good, several broken."""

import math

from prime_rl.orchestrator.advantages import AdvantageInputs, AdvantageOutputs


def scaled_rank(inputs: AdvantageInputs, scale: float = 1.0) -> AdvantageOutputs:
    order = sorted(range(len(inputs.rollouts)), key=lambda i: inputs.rollouts[i].reward)
    ranks = [0.0] * len(order)
    for rank, i in enumerate(order):
        ranks[i] = scale * (rank - (len(order) - 1) / 2)
    return AdvantageOutputs(ranks)


def wrong_length(inputs: AdvantageInputs) -> AdvantageOutputs:
    return AdvantageOutputs([0.0])


def not_finite(inputs: AdvantageInputs) -> AdvantageOutputs:
    return AdvantageOutputs([math.nan] * len(inputs.rollouts))
