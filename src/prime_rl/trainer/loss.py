"""The RL loss of one micro-batch, per token.

Invariant: `rl_loss` returns the per-token loss *before* normalization; the trainer sums it over
the loss tokens and divides by the global loss-token count (all ranks, all micro-batches of the
step), so the gradient is that of the per-token mean over the whole global batch. Tokens that a
mask drops (ratio out of bounds, low entropy) contribute 0 but stay in the count.

The importance ratio compares the trainer's logprobs (current weights, sampling temperature) with
the sampling logprobs from inference: ratio = exp(trainer - sampling), per token or per sample
(GSPO). PPO-style clipping bounds the update; masking drops tokens whose ratio says trainer and
sampler disagree too much to trust the sample.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from prime_rl.trainer.config import LossConfig
from prime_rl.trainer.returns import sample_index


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, all of shape [T]."""

    trainer_logprobs: torch.Tensor
    """Differentiable."""
    sampling_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    """Bool: tokens the policy sampled (completion tokens)."""
    entropy: torch.Tensor
    sample_lens: list[int]
    ref_logprobs: torch.Tensor | None = None
    """Logprobs of the frozen starting model, when a KL penalty is configured."""


@dataclass
class LossOutputs:
    token_loss: torch.Tensor
    """Per-token loss, 0 outside the effective mask."""
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    """Bool per-token flags for metrics (e.g. 'masked_low', 'clipped_high')."""


def sample_ids(sample_lens: list[int], device: torch.device) -> torch.Tensor:
    return sample_index(sample_lens, device)


def importance_log_ratio(inputs: LossInputs, ratio_type: str) -> torch.Tensor:
    log_ratio = (inputs.trainer_logprobs - inputs.sampling_logprobs) * inputs.loss_mask
    if ratio_type == "token":
        return log_ratio
    # GSPO: one ratio per sample (mean log-ratio over its loss tokens), gradients flowing per token.
    ids = sample_ids(inputs.sample_lens, log_ratio.device)
    n = len(inputs.sample_lens)
    sums = torch.zeros(n, device=log_ratio.device).index_add(0, ids, log_ratio.detach())
    counts = torch.zeros(n, device=log_ratio.device).index_add(0, ids, inputs.loss_mask.float())
    seq = (sums / counts.clamp(min=1))[ids]
    return seq + log_ratio - log_ratio.detach()


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy."""
    d = logprobs - ref_logprobs
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d**2
    return torch.exp(-d) + d - 1  # k3: unbiased, always >= 0


def top_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """The masked tokens whose entropy is at least the (1 - fraction) quantile of the masked
    tokens' entropies (linear interpolation, as torch.quantile), computed without a host sync."""
    if fraction >= 1.0:
        return mask
    e = entropy.float()
    ordered = torch.sort(torch.where(mask, e, torch.inf)).values  # the masked values come first
    n = mask.sum()
    pos = (1.0 - fraction) * (n - 1).clamp(min=0).to(e.dtype)
    lo = pos.floor().long().view(1)
    hi = torch.minimum(lo + 1, (n - 1).clamp(min=0))
    threshold = torch.lerp(ordered.index_select(0, lo), ordered.index_select(0, hi), pos - lo)
    return mask & (e >= threshold)


def cpgd_token_loss(log_ratio: torch.Tensor, adv: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """CPGD, clipped policy gradient with policy drift (Liu et al. 2025, "CPGD: Toward Stable
    Rule-based Reinforcement Learning for Language Models", arXiv:2505.12504; LightRFT's `cpgd`).

    The policy gradient follows log(ratio) * A instead of PPO's ratio * A, with the log-ratio clipped
    to [log(1 - clip_low), log(1 + clip_high)] pessimistically (the min, as in PPO), so a token's
    weight cannot grow exponentially with the ratio. The policy drift KL(sampler || trainer) is
    penalized with its low-variance estimate r - 1 - log r (r = ratio, tokens drawn by the sampler),
    whose gradient pulls the ratio back to 1 from either side."""
    low = math.log(1.0 - config.clip_low) if config.clip_low < 1 else -math.inf
    clipped = log_ratio.clamp(low, math.log1p(config.clip_high))
    objective = torch.minimum(log_ratio * adv, clipped * adv)
    drift = torch.exp(log_ratio) - 1.0 - log_ratio
    return -objective + config.drift_coef * drift


def rl_loss(inputs: LossInputs, config: LossConfig) -> LossOutputs:
    mask = inputs.loss_mask
    log_ratio = importance_log_ratio(inputs, config.ratio_type)
    ratio = torch.exp(log_ratio)
    r = ratio.detach()
    masked_low = mask & (r < config.mask_low)
    masked_high = mask & (r > config.mask_high)
    keep = mask & ~masked_low & ~masked_high
    keep = top_entropy_mask(inputs.entropy, keep, config.top_entropy_fraction)
    adv = inputs.advantages
    if config.type == "cpgd":
        loss = cpgd_token_loss(log_ratio, adv, config)
    else:
        clipped = torch.clamp(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high)
        loss = -torch.minimum(ratio * adv, clipped * adv)
    if config.kl_coef > 0 and inputs.ref_logprobs is not None:
        loss = loss + config.kl_coef * kl_penalty(
            inputs.trainer_logprobs, inputs.ref_logprobs, config.kl_estimator
        )
    masks = {
        "masked_low": masked_low,
        "masked_high": masked_high,
        "clipped_low": keep & (adv < 0) & (r < 1.0 - config.clip_low),
        "clipped_high": keep & (adv > 0) & (r > 1.0 + config.clip_high),
    }
    return LossOutputs(loss * keep, masks)


def sft_loss(inputs: LossInputs, config: LossConfig | None = None) -> LossOutputs:
    """Cross-entropy on the loss tokens (the completion), for `uv run sft`."""
    return LossOutputs(-inputs.trainer_logprobs * inputs.loss_mask)
