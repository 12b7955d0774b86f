"""Rollout correction: what to do about the behaviour ratio beta_t = pi_old(y_t) / mu(y_t), the mismatch
between the trainer's policy at the step's start and the sampler's (vLLM's, possibly a few steps
stale), independent of the loss (`[trainer.rollout_correction]`). The loss's own ratio is
pi_theta / pi_old (decoupled; `losses/frame.py`), so the two never multiply the same factor twice:

    tis       each token's loss times w_t = min(beta_t, tis_cap)        (truncated IS, Yao et al. 2025)
    icepop    tokens with beta_t outside [low, high] are dropped        (MIS / IcePop, Ling team 2025)
    seq_mask  samples whose geometric-mean ratio exp(mean_t log beta_t)
              is outside [low, high] are dropped whole                  (sequence-level masking)

Invariant: a correction only reweights or drops tokens of the loss it wraps; it never changes the
loss's own ratio or gradient path, so it composes with every loss. It reads unclamped log-ratios
(a sample's mean is over the true values) and clamps only before `exp`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prime_rl.trainer.losses.config import RolloutCorrectionConfig

LIMIT = 30.0
"""Log-ratios are clamped to +-LIMIT only where they are exponentiated (exp(30) is finite in float32)."""


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
    """The correction of the loss tokens in `mask`; `log_ratio` is log beta = log(pi_old / mu) per
    token, detached and unclamped; `sample_of_token` the sample of each token, of `num_samples`."""
    none = torch.zeros_like(mask)
    if config.type == "tis":
        return Correction(torch.exp(log_ratio.clamp(max=LIMIT)).clamp(max=config.tis_cap), none)
    if config.type == "icepop":
        r = torch.exp(log_ratio.clamp(-LIMIT, LIMIT))
        return Correction(None, mask & ((r < config.low) | (r > config.high)))
    if config.type == "seq_mask":
        ids, n = sample_of_token, num_samples
        sums = torch.zeros(n, dtype=log_ratio.dtype, device=mask.device).index_add(0, ids, log_ratio * mask)
        counts = torch.zeros(n, dtype=log_ratio.dtype, device=mask.device).index_add(
            0, ids, mask.to(log_ratio.dtype)
        )
        geo = torch.exp((sums / counts.clamp(min=1)).clamp(-LIMIT, LIMIT))
        bad = (geo < config.low) | (geo > config.high)
        return Correction(None, mask & bad[ids])
    return Correction(None, none)
