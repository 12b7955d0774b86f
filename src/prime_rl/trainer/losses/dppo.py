"""DPPO + KL, prime-rl's default: a trust region on the change of each token's probability, on the
side the advantage pushes, and a squared log-ratio penalty. Per token, with p = pi(y_t), q =
pi_base(y_t) (the sampler's under its preset, `old_policy = 'sampler'`) and r_t = p / q:

    masked_t = (A_t > 0 and p - q > delta_high) or (A_t <= 0 and p - q < -delta_low)
    loss_t   = -[not masked_t] r_t A_t + kl_tau (log r_t)^2

The mask is DPPO's binary total-variation trust region ("DPPO", arXiv:2602.04879): a token whose
probability already rose by more than delta_high stops being pushed up, one that fell by more than
delta_low stops being pushed down, the other direction stays free. p - q is each token's own, also
under a sequence ratio (`ratio_type = 'sequence'` changes r in the gradient term, not the test).
The (log r)^2 term, on every loss token (also those a mask drops), is Kimi K2.5's KL regularizer
(arXiv:2602.02276): it pulls the trainer back toward the base policy, with a gradient proportional
to log r.
"""

from __future__ import annotations

import torch

from prime_rl.trainer.losses.frame import LossInputs, LossOutputs


def dppo(inputs: LossInputs, delta_low: float, delta_high: float, kl_tau: float) -> LossOutputs:
    log_ratio, adv, keep = inputs.log_ratio, inputs.advantages, inputs.loss_mask
    ratio = torch.exp(log_ratio)
    token_log_ratio = inputs.token_log_ratio
    q = torch.exp(inputs.trainer_logprobs.detach() - token_log_ratio.detach())  # the base policy's
    p = torch.exp(inputs.trainer_logprobs.detach())
    diff = torch.where(keep, p - q, torch.zeros_like(p))
    up, down = adv > 0, adv <= 0
    masked_high = keep & up & (diff > delta_high)
    masked_low = keep & down & (diff < -delta_low)
    trusted = ~(masked_high | masked_low)
    loss = -torch.where(trusted, ratio * adv, torch.zeros_like(ratio))
    penalty = kl_tau * token_log_ratio**2
    return LossOutputs(
        loss, {"dppo_masked_high": masked_high, "dppo_masked_low": masked_low}, every_token=penalty
    )
