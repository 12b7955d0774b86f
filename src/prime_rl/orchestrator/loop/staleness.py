"""Staleness that tunes itself: the async level (how far generation runs ahead of the trainer)
follows the trainer's measured off-policyness, within the user's bounds.

The signal is the effective sample size of the sampler-to-trainer importance ratios of a trainer
step (`is_ratio/all/ess`, 1 when every token's ratio is the same), published with the weights it
produced (`layout.TRAINER_STATS`). Rule, per published step: below `target_ess` the level drops by
one at once (staler samples are what pulls the ESS down); at or above `target_ess + margin` for
`raise_after` published steps in a row it rises by one. Always within [min_level, max_async_level].

Invariant: `adapt` is a pure function of the previous state and one observation, so the level's
whole history is reproducible from the metrics it is logged in (`async/level`, `async/trainer_ess`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from prime_rl.orchestrator.config import AdaptiveAsyncConfig


@dataclass(frozen=True)
class AsyncLevel:
    level: int
    calm: int = 0
    """Consecutive observations above target + margin since the last change."""
    last_ess: float | None = None


def adapt(state: AsyncLevel, ess: float | None, config: AdaptiveAsyncConfig, max_level: int) -> AsyncLevel:
    """The level after observing one trainer step's ESS (None: no observation, no change)."""
    if ess is None:
        return state
    if ess < config.target_ess:
        return AsyncLevel(max(config.min_level, state.level - 1), 0, ess)
    if ess >= config.target_ess + config.margin:
        calm = state.calm + 1
        if calm >= config.raise_after and state.level < max_level:
            return AsyncLevel(state.level + 1, 0, ess)
        return replace(state, calm=calm, last_ess=ess)
    return replace(state, calm=0, last_ess=ess)
