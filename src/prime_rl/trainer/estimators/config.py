"""The token-level estimators' configs: what every estimator shares, each built-in's knobs, and the
registry that names them.

Invariant: this module imports no torch; a built-in's function (`estimators/<name>.py`) is imported
only when a trainer builds it (`build_estimator`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from prime_rl.config import BaseConfig
from prime_rl.config.plugins import Builtin, Registry


class EstimatorBase(BaseConfig):
    """Settings every token-level estimator shares (read by the trainer around the estimator)."""

    moved_keys: ClassVar[dict[str, str]] = {
        "import_path": "name your estimator in 'type' = 'package.module:function'"
    }

    batch_normalize: Literal["none", "all", "env"] = "none"
    """The one normalization of the advantages: whiten the estimator's per-token advantages over the
    step's model tokens on all ranks, over every env ('all') or per env ('env'), before per-token
    terms (distillation) are added. GAE and REINFORCE++ usually want 'all'."""

    @property
    def uses_critic(self) -> bool:
        """Whether the trainer builds and trains a critic for this estimator (its `values`)."""
        return False


class CustomEstimator(EstimatorBase):
    """Your own estimator: `fn(TokenAdvantageInputs, **kwargs) -> TokenAdvantageOutputs`."""

    type: str
    """Where the function lives, as 'package.module:function'."""

    kwargs: dict[str, Any] = {}
    """Keyword arguments passed to the function on every call."""

    critic: bool = False
    """Train a critic (`[trainer.critic]`): the function then gets `values` and must return `returns`."""

    @property
    def uses_critic(self) -> bool:
        return self.critic


class Reinforce(EstimatorBase):
    """The rollout advantage as the terminal reward, discounted per model token."""

    type: Literal["reinforce"] = "reinforce"
    """Selects this estimator."""

    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount per model token."""


class GAE(EstimatorBase):
    """Advantages from the critic's values (trains a critic)."""

    type: Literal["gae"] = "gae"
    """Selects this estimator."""

    gamma: float = Field(default=1.0, ge=0, le=1)
    """Discount per model token."""

    lam: float = Field(default=0.95, ge=0, le=1)
    """GAE's lambda (bias-variance trade-off of the advantage; 1 gives Monte-Carlo returns minus values)."""

    @property
    def uses_critic(self) -> bool:
        return True


ESTIMATORS = Registry("token-level estimator", EstimatorBase, CustomEstimator, [
    Builtin("reinforce", "prime_rl.trainer.estimators.reinforce:reinforce", Reinforce),
    Builtin("gae", "prime_rl.trainer.estimators.gae:gae_estimator", GAE),
])  # fmt: skip

EstimatorConfig = ESTIMATORS.config_type()
