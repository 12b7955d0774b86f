"""PPO's clipped surrogate (Schulman et al. 2017, "Proximal Policy Optimization Algorithms",
arXiv:1707.06347), per token:

    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t),   r_t = pi(y_t) / mu(y_t)

with the asymmetric bounds of DAPO (Yu et al. 2025, arXiv:2503.14476) by default. The default loss.
"""

from __future__ import annotations

import torch

from prime_rl.trainer.losses.frame import LossInputs, LossOutputs


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
