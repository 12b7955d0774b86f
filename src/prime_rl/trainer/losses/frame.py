"""What every RL loss shares at run time: its inputs and outputs, and the frame that runs it
(`frame`): the importance ratio, the trust masks, the KL penalty. (Its config's common fields are
`LossBase`, in `losses/config.py`.)

Invariant: a loss returns the per-token loss *before* normalization; the trainer sums it over the
loss tokens and divides by the global loss-token count (all ranks, all micro-batches of the step),
so the gradient is that of the per-token mean over the whole global batch. Tokens that a mask drops
(ratio out of bounds, low entropy) contribute 0 but stay in the count.

The importance ratio compares the trainer's logprobs (current weights, sampling temperature) with
the sampling logprobs from inference: ratio = exp(trainer - sampling), per token or per sample
(GSPO). Masking drops tokens whose ratio says trainer and sampler disagree too much to trust them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from prime_rl.trainer.batch import sample_index
from prime_rl.trainer.losses.config import LOSSES, LossBase, RolloutCorrectionConfig
from prime_rl.trainer.losses.correction import correct


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, all of shape [T]."""

    trainer_logprobs: torch.Tensor
    """Differentiable."""
    sampling_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    """Bool: the tokens that train. In a loss called by the frame: the sampled tokens the trust
    masks kept."""
    entropy: torch.Tensor
    """Of the trainer's next-token distribution; differentiable when the loss has an entropy bonus."""
    sample_lens: list[int]
    ref_logprobs: torch.Tensor | None = None
    """Logprobs of the frozen starting model, when a KL penalty is configured."""
    log_ratio: torch.Tensor | None = None
    """log(trainer / sampling) per token, or per sample with `ratio_type = 'sequence'` (then the same
    on each of its tokens, gradients flowing per token); differentiable, 0 outside the loss mask
    (so it is finite wherever a loss reads it). Set by the frame."""
    sample_of_token: torch.Tensor | None = None
    """[T] int64: the sample each token belongs to; built from `sample_lens` when not given (the
    trainer hands over its batch's)."""

    def __post_init__(self) -> None:
        if self.sample_of_token is None:
            self.sample_of_token = sample_index(self.sample_lens, self.loss_mask.device)


@dataclass
class LossOutputs:
    token_loss: torch.Tensor
    """Per-token loss (the frame zeroes it outside the kept tokens)."""
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    """Bool per-token flags for metrics (e.g. 'clipped_high'): their share of the loss tokens is logged."""
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    """Float per-token metrics over the loss tokens (e.g. 'is_ratio'): mean, std, max (and the
    effective sample size of 'is_ratio') are logged."""


def importance_log_ratio(inputs: LossInputs, ratio_type: str) -> torch.Tensor:
    log_ratio = (inputs.trainer_logprobs - inputs.sampling_logprobs) * inputs.loss_mask
    if ratio_type == "token":
        return log_ratio
    # GSPO: one ratio per sample (mean log-ratio over its loss tokens), gradients flowing per token.
    ids = inputs.sample_of_token
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


def frame(
    inputs: LossInputs, config: LossBase, loss, correction: RolloutCorrectionConfig | None = None, **kwargs
) -> LossOutputs:
    """Run one loss (`loss(inputs, **kwargs)`) inside what every loss shares: the importance
    log-ratio, the trust masks (`mask_low`, `mask_high`, `top_entropy_fraction`), the rollout
    correction and the KL penalty to the reference model."""
    mask = inputs.loss_mask
    log_ratio = importance_log_ratio(inputs, config.ratio_type)
    r = torch.exp(log_ratio.detach())
    masked_low = mask & (r < config.mask_low)
    masked_high = mask & (r > config.mask_high)
    # The sampler-to-trainer mismatch per token, whatever the loss's own ratio (the token's, not
    # GSPO's sequence mean): what the rollout correction and its metrics look at.
    token_log_ratio = ((inputs.trainer_logprobs.detach() - inputs.sampling_logprobs) * mask).clamp(
        -30.0, 30.0
    )
    fix = correct(
        token_log_ratio,
        mask,
        inputs.sample_of_token,
        len(inputs.sample_lens),
        correction or RolloutCorrectionConfig(),
    )
    keep = top_entropy_mask(
        inputs.entropy, mask & ~masked_low & ~masked_high & ~fix.dropped, config.top_entropy_fraction
    )
    # The loss sees a log-ratio of 0 on every token it does not keep: a token sampled far below the
    # trainer's probability (log-ratio > 88.7 in float32) would make exp(log_ratio) inf, and its
    # zeroed loss 0 * inf = NaN in value and gradient, costing the whole step.
    log_ratio = torch.where(keep, log_ratio, torch.zeros_like(log_ratio))
    out = loss(replace(inputs, loss_mask=keep, log_ratio=log_ratio), **kwargs)
    token_loss = out.token_loss
    if fix.weight is not None:
        token_loss = token_loss * torch.where(keep, fix.weight, torch.ones_like(fix.weight))
    if config.entropy_coef > 0:
        token_loss = token_loss - config.entropy_coef * inputs.entropy
    if config.kl_coef > 0 and inputs.ref_logprobs is not None:
        token_loss = token_loss + config.kl_coef * kl_penalty(
            inputs.trainer_logprobs, inputs.ref_logprobs, config.kl_estimator
        )
    masks = {"masked_low": masked_low, "masked_high": masked_high, **out.masks}
    # The sampler-to-trainer ratio of every loss token, always: its ESS says how off-policy a step is.
    values = {"is_ratio": torch.exp(token_log_ratio), **out.values}
    if correction is not None and correction.type in ("icepop", "seq_mask"):
        masks["correction_dropped"] = fix.dropped
    if fix.weight is not None:
        values["is_weight"] = fix.weight
    return LossOutputs(token_loss * keep, masks, values)


LossFn = Callable[[LossInputs], LossOutputs]


def build_loss(
    config: LossBase, key: str = "trainer.loss", correction: RolloutCorrectionConfig | None = None
) -> LossFn:
    """The configured loss inside its frame (with the rollout correction, if any), as one function
    of the micro-batch's inputs; a built-in's function is imported here."""
    loss = LOSSES.resolve(config, key)
    return partial(frame, config=config, loss=loss.fn, correction=correction, **loss.kwargs)
