"""CPGD, clipped policy gradient with policy drift (Liu et al. 2025, "CPGD: Toward Stable
Rule-based Reinforcement Learning for Language Models", arXiv:2505.12504; LightRFT's `cpgd`):

    loss_t = -min(log r_t A_t, clip(log r_t, log(1 - clip_low), log(1 + clip_high)) A_t)
             + drift_coef (r_t - 1 - log r_t)

The policy gradient follows log(ratio) * A instead of PPO's ratio * A, clipped pessimistically (the
min, as in PPO), so a token's weight cannot grow exponentially with the ratio. The policy drift
KL(sampler || trainer) is penalized with its low-variance estimate r - 1 - log r (tokens drawn by
the sampler), whose gradient pulls the ratio back to 1 from either side.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from prime_rl.plugins import Builtin
from prime_rl.trainer.losses.base import LossBase, LossInputs, LossOutputs


class CPGDLoss(LossBase):
    """The clipped log-ratio times the advantage, plus a policy-drift penalty."""

    type: Literal["cpgd"] = "cpgd"
    """Selects this loss."""

    clip_low: float = Field(default=0.2, ge=0)
    """The log-ratio is clipped below at log(1 - clip_low)."""

    clip_high: float = Field(default=0.28, ge=0)
    """The log-ratio is clipped above at log(1 + clip_high)."""

    drift_coef: float = Field(default=0.1, ge=0)
    """Weight of the policy-drift penalty."""


def cpgd(inputs: LossInputs, clip_low: float, clip_high: float, drift_coef: float) -> LossOutputs:
    log_ratio, adv = inputs.log_ratio, inputs.advantages
    low = math.log(1.0 - clip_low) if clip_low < 1 else -math.inf
    clipped = log_ratio.clamp(low, math.log1p(clip_high))
    objective = torch.minimum(log_ratio * adv, clipped * adv)
    drift = torch.exp(log_ratio) - 1.0 - log_ratio
    r, keep = torch.exp(log_ratio.detach()), inputs.loss_mask
    masks = {
        "clipped_low": keep & (adv < 0) & (r < 1.0 - clip_low),
        "clipped_high": keep & (adv > 0) & (r > 1.0 + clip_high),
    }
    return LossOutputs(-objective + drift_coef * drift, masks)


BUILTIN = Builtin("cpgd", cpgd, CPGDLoss)
