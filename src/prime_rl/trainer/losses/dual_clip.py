"""Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep Reinforcement
Learning", arXiv:1912.09729, eq. 5): PPO's clipped surrogate, and for a negative advantage a second
bound c |A| on the loss, per token:

    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)          if A_t >= 0
    loss_t = -max(min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), c A_t)  if A_t < 0

With A < 0 and a ratio far above 1 (a token the trainer now likes much more than the sampler did),
PPO's loss -r A grows without bound with r; the second clip caps it at -c A, and its gradient there
is 0.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from prime_rl.plugins import Builtin
from prime_rl.trainer.losses.base import LossBase, LossInputs, LossOutputs


class DualClipLoss(LossBase):
    """PPO's clipped surrogate with a lower bound for negative advantages."""

    type: Literal["dual_clip"] = "dual_clip"
    """Selects this loss."""

    clip_low: float = Field(default=0.2, ge=0)
    """The ratio is clipped below at 1 - clip_low."""

    clip_high: float = Field(default=0.28, ge=0)
    """The ratio is clipped above at 1 + clip_high."""

    clip_c: float = Field(default=3.0, gt=1)
    """The bound for negative advantages: the surrogate is at least c A (c > 1)."""


def dual_clip(inputs: LossInputs, clip_low: float, clip_high: float, clip_c: float) -> LossOutputs:
    ratio = torch.exp(inputs.log_ratio)
    adv, r, keep = inputs.advantages, ratio.detach(), inputs.loss_mask
    surrogate = torch.minimum(ratio * adv, torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv)
    bounded = torch.where(adv < 0, torch.maximum(surrogate, clip_c * adv), surrogate)
    masks = {
        "clipped_low": keep & (adv < 0) & (r < 1.0 - clip_low),
        "clipped_high": keep & (adv > 0) & (r > 1.0 + clip_high),
        "clipped_dual": keep & (adv < 0) & (r > clip_c),
    }
    return LossOutputs(-bounded, masks)


BUILTIN = Builtin("dual_clip", dual_clip, DualClipLoss)
