"""Rollout correction: what to do about the mismatch between the sampler's probabilities (vLLM's) and
the trainer's, independent of the loss (`[trainer.rollout_correction]`).

With r_t = pi_trainer(y_t) / mu_sampler(y_t), taken without gradient (the trainer's logprobs at the
start of the step, the "old" policy of a single-update step):

    tis       each token's loss times min(r_t, tis_cap)               (truncated IS, Yao et al. 2025)
    icepop    tokens with r_t outside [low, high] are dropped           (MIS / IcePop, Ling team 2025)
    seq_mask  samples whose geometric-mean ratio exp(mean_t log r_t)
              is outside [low, high] are dropped whole                  (sequence-level masking)

Invariant: a correction only reweights or drops tokens of the loss it wraps; it never changes the
loss's own ratio or gradient path, so it composes with every loss. Where a loss already weights by
the importance ratio (CISPO), TIS multiplies a second truncated weight on top.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prime_rl.trainer.losses.config import RolloutCorrectionConfig


@dataclass
class Correction:
    weight: torch.Tensor | None
    """[T] factor on each token's loss (None: 1)."""
    dropped: torch.Tensor
    """[T] bool: the loss tokens the correction drops."""


def correct(
    log_ratio: torch.Tensor,
    mask: torch.Tensor,
    sample_of_token: torch.Tensor,
    num_samples: int,
    config: RolloutCorrectionConfig,
) -> Correction:
    """The correction of the loss tokens in `mask`; `log_ratio` is log(trainer / sampler), detached;
    `sample_of_token` the sample of each token, of `num_samples`."""
    none = torch.zeros_like(mask)
    if config.type == "tis":
        return Correction(torch.exp(log_ratio.clamp(max=30.0)).clamp(max=config.tis_cap), none)
    if config.type == "icepop":
        r = torch.exp(log_ratio.clamp(-30.0, 30.0))
        return Correction(None, mask & ((r < config.low) | (r > config.high)))
    if config.type == "seq_mask":
        ids, n = sample_of_token, num_samples
        sums = torch.zeros(n, dtype=log_ratio.dtype, device=mask.device).index_add(0, ids, log_ratio * mask)
        counts = torch.zeros(n, dtype=log_ratio.dtype, device=mask.device).index_add(
            0, ids, mask.to(log_ratio.dtype)
        )
        geo = torch.exp((sums / counts.clamp(min=1)).clamp(-30.0, 30.0))
        bad = (geo < config.low) | (geo > config.high)
        return Correction(None, mask & bad[ids])
    return Correction(None, none)
