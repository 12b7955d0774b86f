"""The RL losses: one module per built-in function (`losses/<name>.py`), their configs and registry in
`losses/config.py`, the frame every loss runs in in `losses/frame.py`.

Adding a built-in: write `losses/<name>.py` with `<name>(inputs: LossInputs, **its fields) ->
LossOutputs`; add its `<Name>Loss(LossBase)` config (`type: Literal["<name>"]`) to `losses/config.py`
and a `Builtin("<name>", "prime_rl.trainer.losses.<name>:<name>", <Name>Loss)` to `LOSSES`.

Importing this package loads no torch: the run-time names (`LossInputs`, `LossOutputs`, `LossFn`,
`build_loss`) are loaded from `losses/frame.py` on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prime_rl.config.plugins import lazy_names
from prime_rl.trainer.losses.config import LOSSES, LossConfig

if TYPE_CHECKING:
    from prime_rl.trainer.losses.frame import LossFn, LossInputs, LossOutputs, build_loss

LAZY = {"prime_rl.trainer.losses.frame": ("LossFn", "LossInputs", "LossOutputs", "build_loss")}
__getattr__ = lazy_names(__name__, LAZY)


__all__ = ["LOSSES", "LossConfig", "LossFn", "LossInputs", "LossOutputs", "build_loss"]
