"""KL to the reference model as a per-token reward, and the controller that sets its weight.

Invariant: the penalty is -beta * KL_t on model tokens only (0 elsewhere), computed from the
sampling logprobs (the policy that produced the tokens) and the reference's, never differentiated:
it is a reward. beta changes only between steps, and every rank holds the same beta because the
KL it reacts to is reduced over all ranks first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from prime_rl.trainer.losses.frame import kl_penalty

MAX_PROPORTIONAL_ERROR = 0.2
"""Ziegler et al. 2019 clip the controller's relative error to +-0.2 per update."""


def kl_rewards(
    sampling_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    beta: float,
    estimator: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token reward -beta * KL_t, per-token KL_t), both 0 outside the loss mask."""
    kl = kl_penalty(sampling_logprobs.float(), ref_logprobs.float(), estimator) * loss_mask
    return -beta * kl, kl


@dataclass(frozen=True)
class KLController:
    """beta, fixed (target None) or adaptive: each step it moves beta so that the KL per sample
    approaches `target`, by at most 20% of horizon-scaled steps."""

    beta: float
    target: float | None = None
    horizon: int = 10000

    def update(self, kl_per_sample: float, num_samples: int) -> KLController:
        if self.target is None or num_samples == 0:
            return self
        error = min(max(kl_per_sample / self.target - 1.0, -MAX_PROPORTIONAL_ERROR), MAX_PROPORTIONAL_ERROR)
        return replace(self, beta=self.beta * (1.0 + error * num_samples / self.horizon))
