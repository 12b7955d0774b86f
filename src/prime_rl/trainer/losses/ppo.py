"""PPO's clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
arXiv:1707.06347), per token:

    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t),   r_t = pi(y_t) / mu(y_t)

with the asymmetric bounds of DAPO (Yu et al. 2025, arXiv:2503.14476) by default. The default loss.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from prime_rl.plugins import Builtin
from prime_rl.trainer.losses.base import LossBase, LossInputs, LossOutputs


class PPOLoss(LossBase):
    """The clipped importance ratio times the advantage."""

    type: Literal["ppo"] = "ppo"
    """Selects this loss."""

    clip_low: float = Field(default=0.2, ge=0)
    """The ratio is clipped below at 1 - clip_low."""

    clip_high: float = Field(default=0.28, ge=0)
    """The ratio is clipped above at 1 + clip_high."""


def ppo(inputs: LossInputs, clip_low: float, clip_high: float) -> LossOutputs:
    ratio = torch.exp(inputs.log_ratio)
    adv, r = inputs.advantages, ratio.detach()
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    keep = inputs.loss_mask
    masks = {
        "clipped_low": keep & (adv < 0) & (r < 1.0 - clip_low),
        "clipped_high": keep & (adv > 0) & (r > 1.0 + clip_high),
    }
    return LossOutputs(-torch.minimum(ratio * adv, clipped * adv), masks)


BUILTIN = Builtin("ppo", ppo, PPOLoss)
