"""The RL losses: one module per built-in (its function and its config), listed once below.

Adding a built-in: write `losses/<name>.py` with a `<Name>Loss(LossBase)` config (`type:
Literal["<name>"]`) and `<name>(inputs: LossInputs, **its fields) -> LossOutputs`, ending with
`BUILTIN = Builtin("<name>", <name>, <Name>Loss)`; add it to `LOSSES`. `frame` runs it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from prime_rl.plugins import Registry
from prime_rl.trainer.losses import cispo, cpgd, dppo, dual_clip, ppo, sapo
from prime_rl.trainer.losses.base import CustomLoss, LossBase, LossInputs, LossOutputs, frame
from prime_rl.trainer.losses.correction import RolloutCorrectionConfig

LOSSES = Registry("loss", LossBase, CustomLoss, [
    ppo.BUILTIN,
    cpgd.BUILTIN,
    cispo.BUILTIN,
    dual_clip.BUILTIN,
    sapo.BUILTIN,
    dppo.BUILTIN,
])  # fmt: skip

LossConfig = LOSSES.config_type()

LossFn = Callable[[LossInputs], LossOutputs]


def build_loss(
    config: LossBase, key: str = "trainer.loss", correction: RolloutCorrectionConfig | None = None
) -> LossFn:
    """The configured loss inside its frame (with the rollout correction, if any), as one function
    of the micro-batch's inputs."""
    loss = LOSSES.resolve(config, key)
    return partial(frame, config=config, loss=loss.fn, correction=correction, **loss.kwargs)


__all__ = ["LOSSES", "LossConfig", "LossFn", "LossInputs", "LossOutputs", "build_loss"]
