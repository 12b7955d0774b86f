"""SAPO, soft adaptive policy optimization (Gao et al. 2025, "Soft Adaptive Policy Optimization",
arXiv:2511.20347): a smooth gate on the ratio instead of PPO's hard clip, per token:

    loss_t = -(4 / tau_t) sigmoid(tau_t (r_t - 1)) A_t,   tau_t = tau_pos if A_t > 0 else tau_neg

The gate's slope, sigmoid'(.) x 4 = 1 at r = 1, so on-policy tokens get PPO's gradient, and it
decays smoothly as the ratio leaves 1 (no band edge where the gradient drops to 0). A larger tau_neg
damps negative-advantage updates faster: the paper reports they destabilize training sooner.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from prime_rl.plugins import Builtin
from prime_rl.trainer.losses.base import LossBase, LossInputs, LossOutputs


class SAPOLoss(LossBase):
    """A temperature-controlled sigmoid gate on the ratio, per advantage sign."""

    type: Literal["sapo"] = "sapo"
    """Selects this loss."""

    tau_pos: float = Field(default=1.0, gt=0)
    """Gate temperature for tokens with a positive advantage."""

    tau_neg: float = Field(default=1.05, gt=0)
    """Gate temperature for tokens with a zero or negative advantage."""


def sapo(inputs: LossInputs, tau_pos: float, tau_neg: float) -> LossOutputs:
    ratio = torch.exp(inputs.log_ratio)
    adv = inputs.advantages
    tau = torch.where(adv > 0, tau_pos, tau_neg).to(ratio.dtype)
    gate = (4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0))
    return LossOutputs(-gate * adv)


BUILTIN = Builtin("sapo", sapo, SAPOLoss)
