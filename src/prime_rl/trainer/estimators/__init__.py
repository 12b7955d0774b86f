"""Token-level advantage estimators: one module per built-in function (`estimators/<name>.py`), their
configs and registry in `estimators/config.py`, what every estimator gets and returns in
`estimators/base.py`.

Adding a built-in: write `estimators/<name>.py` with `<name>(inputs: TokenAdvantageInputs, **its
fields) -> TokenAdvantageOutputs`; add its config (subclassing `EstimatorBase`, with `type:
Literal["<name>"]`) to `estimators/config.py` and a `Builtin("<name>",
"prime_rl.trainer.estimators.<name>:<name>", <Config>)` to `ESTIMATORS`.

Importing this package loads no torch: the run-time names are loaded from `estimators/base.py` on
first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prime_rl.config.plugins import lazy_names
from prime_rl.trainer.estimators.config import ESTIMATORS, EstimatorConfig

if TYPE_CHECKING:
    from prime_rl.trainer.estimators.base import (
        Estimator,
        TokenAdvantageError,
        TokenAdvantageInputs,
        TokenAdvantageOutputs,
        build_estimator,
    )

LAZY = {
    "prime_rl.trainer.estimators.base": (
        "Estimator",
        "TokenAdvantageError",
        "TokenAdvantageInputs",
        "TokenAdvantageOutputs",
        "build_estimator",
    )
}
__getattr__ = lazy_names(__name__, LAZY)


__all__ = [
    "ESTIMATORS",
    "Estimator",
    "EstimatorConfig",
    "TokenAdvantageError",
    "TokenAdvantageInputs",
    "TokenAdvantageOutputs",
    "build_estimator",
]
