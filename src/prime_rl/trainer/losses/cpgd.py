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

import torch

from prime_rl.trainer.losses.frame import LossInputs, LossOutputs


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
