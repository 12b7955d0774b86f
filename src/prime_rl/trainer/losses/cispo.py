"""CISPO (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
Attention", arXiv:2506.13585, eq. 4): the clipped importance weight, with its gradient stopped,
times the advantage times log pi, so every token keeps a gradient:

    loss_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_t log pi(y_t)

PPO's clip zeroes the gradient of a token whose ratio left the band in the advantage's direction
(often the rare tokens that fork a reasoning path); CISPO bounds the token's weight instead. The
paper sets no lower bound (clip_low = 1) and tunes clip_high only.

Under the default `old_policy = 'sampler'`, r_t = pi/mu already weights by the sampler's mismatch,
and a 'tis' rollout correction is refused. Under 'trainer', r_t = pi/pi_old, and 'tis' multiplies
the token's loss by min(pi_old/mu, tis_cap) as well: the product of the two bounded factors stands
for pi/mu, each part capped on its own (with one mini-batch pi_old = sg(pi), so r_t = 1 and the TIS
weight is the token's only weight).
"""

from __future__ import annotations

import torch

from prime_rl.trainer.losses.frame import LossInputs, LossOutputs


def cispo(inputs: LossInputs, clip_low: float, clip_high: float) -> LossOutputs:
    weight = torch.exp(inputs.log_ratio.detach()).clamp(1.0 - clip_low, 1.0 + clip_high)
    return LossOutputs(-weight * inputs.advantages * inputs.trainer_logprobs)
