"""What every RL loss shares at run time: its inputs and outputs, and the frame that runs it
(`frame`): the two ratios, the trust masks, the behaviour correction, the KL penalty. (Its config's
common fields are `LossBase`, in `losses/config.py`; the algebra is written out in docs/trainer.md.)

Three policies meet in a step: pi_theta (the trainer's, differentiated), pi_old (the trainer's at
the step's start, without gradient) and mu (the sampler's, whose logprobs came with the rollouts).
The frame splits their mismatch in two, as decoupled PPO does:

    rho_t  = pi_theta(y_t) / pi_base(y_t)   the loss's ratio: pi_base = mu (`old_policy =
                                            'sampler'`, the default) or pi_old ('trainer')
    beta_t = pi_old(y_t) / mu(y_t)          the behaviour ratio: what the trust masks and the
                                            rollout correction w(beta) look at

    loss_t = w(beta_t) * loss(rho_t, A_t)   on the tokens the masks keep

With one optimizer step per batch pi_old = sg(pi_theta), with no extra forward: the behaviour ratio
is the trainer's over the sampler's, and under 'trainer' rho is 1 in value and grad log pi in
gradient. Several mini-batches (`[trainer] mini_batches`) hand the frame pi_old from the step's
first pass.

Invariant: a loss returns the per-token loss *before* normalization; the trainer sums it over the
loss tokens and divides by the global loss-token count (all ranks, all micro-batches of the step),
so the gradient is that of the per-token mean over the whole global batch. Tokens that a mask drops
contribute 0 but stay in the count. Every ratio is computed from unclamped log-ratios; they are
clamped only where they are exponentiated.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial

import torch

from prime_rl.trainer.batch import sample_index
from prime_rl.trainer.losses.config import LOSSES, LossBase, RolloutCorrectionConfig
from prime_rl.trainer.losses.correction import LIMIT, correct


@dataclass
class LossInputs:
    """Per-token tensors of one micro-batch, all of shape [T]."""

    trainer_logprobs: torch.Tensor
    """Differentiable."""
    sampling_logprobs: torch.Tensor
    advantages: torch.Tensor
    loss_mask: torch.Tensor
    """Bool: the tokens that train. In a loss called by the frame: the sampled tokens the masks
    kept."""
    entropy: torch.Tensor
    """Of the trainer's next-token distribution; differentiable when the loss has an entropy bonus."""
    sample_lens: list[int]
    ref_logprobs: torch.Tensor | None = None
    """Logprobs of the frozen starting model, when a KL penalty is configured."""
    old_logprobs: torch.Tensor | None = None
    """pi_old: the trainer's logprobs at the step's start, without gradient (None: the trainer's own,
    detached, which is pi_old when the step makes one optimizer step)."""
    log_ratio: torch.Tensor | None = None
    """log rho = log(trainer / base) per token, or per sample with `ratio_type = 'sequence'` (then the
    same on each of its tokens, gradients flowing per token); differentiable, 0 outside the loss mask
    (so it is finite wherever a loss reads it). Set by the frame."""
    token_log_ratio: torch.Tensor | None = None
    """log rho per token on every loss token, kept or dropped (0 elsewhere), differentiable: for a
    term a loss keeps on every token (DPPO's penalty). Set by the frame."""
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
    every_token: torch.Tensor | None = None
    """A per-token term kept on every loss token, also those the masks dropped (DPPO's penalty)."""


def per_sample_mean(log_ratio: torch.Tensor, mask: torch.Tensor, ids: torch.Tensor, n: int) -> torch.Tensor:
    """[T]: the mean of `log_ratio` over each sample's `mask` tokens, on each of its tokens."""
    sums = torch.zeros(n, dtype=log_ratio.dtype, device=mask.device).index_add(0, ids, log_ratio * mask)
    counts = torch.zeros(n, dtype=log_ratio.dtype, device=mask.device).index_add(
        0, ids, mask.to(log_ratio.dtype)
    )
    return (sums / counts.clamp(min=1))[ids]


def importance_log_ratio(
    trainer: torch.Tensor, base: torch.Tensor, inputs: LossInputs, ratio_type: str
) -> torch.Tensor:
    """log(trainer / base) on the loss tokens (0 elsewhere): per token, or GSPO's one ratio per sample
    (the mean over its loss tokens) with gradients flowing per token."""
    log_ratio = (trainer - base) * inputs.loss_mask
    if ratio_type == "token":
        return log_ratio
    seq = per_sample_mean(
        log_ratio.detach(), inputs.loss_mask, inputs.sample_of_token, len(inputs.sample_lens)
    )
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
    """Run one loss (`loss(inputs, **kwargs)`) inside what every loss shares: the loss's ratio and
    the behaviour ratio, the trust masks (`mask_low`, `mask_high`, `top_entropy_fraction`), the
    rollout correction and the KL penalty to the reference model."""
    mask = inputs.loss_mask
    old = inputs.old_logprobs if inputs.old_logprobs is not None else inputs.trainer_logprobs.detach()
    base = old if config.old_policy == "trainer" else inputs.sampling_logprobs
    token_log_ratio = importance_log_ratio(inputs.trainer_logprobs, base, inputs, "token")
    log_ratio = importance_log_ratio(inputs.trainer_logprobs, base, inputs, config.ratio_type)
    # The behaviour ratio, at the loss's granularity for the trust masks and per token for the
    # correction and its metrics (the correction takes the sample's mean itself for seq_mask).
    behaviour = ((old - inputs.sampling_logprobs) * mask).detach()
    trust = behaviour
    if config.ratio_type == "sequence":
        trust = per_sample_mean(behaviour, mask, inputs.sample_of_token, len(inputs.sample_lens))
    beta = torch.exp(trust.clamp(-LIMIT, LIMIT))
    masked_low = mask & (beta < config.mask_low)
    masked_high = mask & (beta > config.mask_high)
    fix = correct(
        behaviour,
        mask,
        inputs.sample_of_token,
        len(inputs.sample_lens),
        correction or RolloutCorrectionConfig(),
    )
    trusted = mask & ~fix.dropped
    if type(config).frame_masks:
        trusted = trusted & ~masked_low & ~masked_high
    keep = top_entropy_mask(inputs.entropy, trusted, config.top_entropy_fraction)
    # The loss sees a log-ratio of 0 on every token it does not keep: a token sampled far below the
    # trainer's probability (log-ratio > 88.7 in float32) would make exp(log_ratio) inf, and its
    # zeroed loss 0 * inf = NaN in value and gradient, costing the whole step.
    log_ratio = torch.where(keep, log_ratio, torch.zeros_like(log_ratio))
    out = loss(
        replace(inputs, loss_mask=keep, log_ratio=log_ratio, token_log_ratio=token_log_ratio), **kwargs
    )
    token_loss = out.token_loss
    if fix.weight is not None:
        token_loss = token_loss * torch.where(keep, fix.weight, torch.ones_like(fix.weight))
    if config.entropy_coef > 0:
        token_loss = token_loss - config.entropy_coef * inputs.entropy
    if config.kl_coef > 0 and inputs.ref_logprobs is not None:
        token_loss = token_loss + config.kl_coef * kl_penalty(
            inputs.trainer_logprobs, inputs.ref_logprobs, config.kl_estimator
        )
    token_loss = token_loss * keep
    if out.every_token is not None:
        token_loss = token_loss + out.every_token * mask
    masks = {"masked_low": masked_low, "masked_high": masked_high} if type(config).frame_masks else {}
    masks.update(out.masks)
    # The behaviour ratio of every loss token, always: its ESS says how off-policy a step is.
    values = {"is_ratio": torch.exp(behaviour.clamp(-LIMIT, LIMIT)), **out.values}
    if correction is not None and correction.type in ("icepop", "seq_mask"):
        masks["correction_dropped"] = fix.dropped
    if fix.weight is not None:
        values["is_weight"] = fix.weight
    return LossOutputs(token_loss, masks, values)


LossFn = Callable[[LossInputs], LossOutputs]


def build_loss(
    config: LossBase, key: str = "trainer.loss", correction: RolloutCorrectionConfig | None = None
) -> LossFn:
    """The configured loss inside its frame (with the rollout correction, if any), as one function
    of the micro-batch's inputs; a built-in's function is imported here."""
    loss = LOSSES.resolve(config, key)
    return partial(frame, config=config, loss=loss.fn, correction=correction, **loss.kwargs)
