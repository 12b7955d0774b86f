"""How per-token losses become the step's loss: one scalar over the whole global batch (all ranks,
all micro-batches), in one of four modes.

    token-mean               sum_i sum_t l_it / N_tokens            (DAPO; the default)
    seq-mean-token-sum       sum_i sum_t l_it / N_samples
    seq-mean-token-mean      sum_i (sum_t l_it / n_i) / N_samples   (GRPO's paper, GSPO)
    seq-mean-token-sum-norm  sum_i (sum_t l_it / C) / N_samples     (Dr. GRPO: a constant C)

with n_i the loss tokens of sample i, N_tokens and N_samples the global counts of loss tokens and
of samples with at least one. Invariant: each mode is a per-token weight times a global divisor
(`token_weights`, `divisor`), so a micro-batch's backward needs only its own tokens and two numbers
reduced once per step; the result is the same whatever the dp x cp split.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prime_rl.trainer.losses.config import Aggregation


def token_weights(
    mode: Aggregation, loss_tokens: Sequence[int], sample_of_token: torch.Tensor, norm: float
) -> torch.Tensor | None:
    """[T] weight of each token's loss (None: all 1). `loss_tokens`: n_i of each sample of the
    micro-batch (counted over the whole sample, whatever rank holds which of its tokens);
    `sample_of_token`: the sample of each token."""
    if mode in ("token-mean", "seq-mean-token-sum"):
        return None
    if mode == "seq-mean-token-sum-norm":
        return torch.full(sample_of_token.shape, 1.0 / norm, device=sample_of_token.device)
    per_sample = torch.tensor([1.0 / max(n, 1) for n in loss_tokens], device=sample_of_token.device)
    return per_sample[sample_of_token]


def divisor(mode: Aggregation, global_tokens: float, global_samples: float) -> float:
    """The global count the weighted sum is divided by (at least 1)."""
    return max(global_tokens if mode == "token-mean" else global_samples, 1.0)
