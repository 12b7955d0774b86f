"""Token-level advantage estimators: one module per built-in (its function and its config), listed
once below.

Adding a built-in: write `estimators/<name>.py` with a config subclassing `EstimatorBase` (`type:
Literal["<name>"]`) and `<name>(inputs: TokenAdvantageInputs, **its fields) -> TokenAdvantageOutputs`,
ending with `BUILTIN = Builtin("<name>", <name>, <Config>)`; add it to `ESTIMATORS`.
"""

from __future__ import annotations

from prime_rl.plugins import Registry
from prime_rl.trainer.estimators import gae, reinforce
from prime_rl.trainer.estimators.base import (
    CustomEstimator,
    Estimator,
    EstimatorBase,
    TokenAdvantageError,
    TokenAdvantageInputs,
    TokenAdvantageOutputs,
)

ESTIMATORS = Registry("token-level estimator", EstimatorBase, CustomEstimator, [
    reinforce.BUILTIN,
    gae.BUILTIN,
])  # fmt: skip

EstimatorConfig = ESTIMATORS.config_type()


def build_estimator(config: EstimatorBase, key: str = "trainer.advantage") -> Estimator:
    found = ESTIMATORS.resolve(config, key)
    return Estimator(found.name, found.fn, found.kwargs)


__all__ = [
    "ESTIMATORS",
    "Estimator",
    "EstimatorConfig",
    "TokenAdvantageError",
    "TokenAdvantageInputs",
    "TokenAdvantageOutputs",
    "build_estimator",
]
