"""SAPO, soft adaptive policy optimization (Gao et al. 2025, "Soft Adaptive Policy Optimization",
arXiv:2511.20347): a smooth gate on the ratio instead of PPO's hard clip, per token:

    loss_t = -(4 / tau_t) sigmoid(tau_t (r_t - 1)) A_t,   tau_t = tau_pos if A_t > 0 else tau_neg

The gate's slope, sigmoid'(.) x 4 = 1 at r = 1, so on-policy tokens get PPO's gradient, and it
decays smoothly as the ratio leaves 1 (no band edge where the gradient drops to 0). A larger tau_neg
damps negative-advantage updates faster: the paper reports they destabilize training sooner.
"""

from __future__ import annotations

import torch

from prime_rl.trainer.losses.frame import LossInputs, LossOutputs


def sapo(inputs: LossInputs, tau_pos: float, tau_neg: float) -> LossOutputs:
    ratio = torch.exp(inputs.log_ratio)
    adv = inputs.advantages
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    return LossOutputs(-gate * adv)
