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

import torch

from prime_rl.trainer.losses.frame import LossInputs, LossOutputs


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
