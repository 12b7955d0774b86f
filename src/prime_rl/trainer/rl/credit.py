"""Credit assignment in the trainer: the one place where the separate terms that travel with a
micro-batch become the per-token advantages the loss sees.

    A_t = normalize(estimate_t) + d_t

- estimate_t: the token-level estimator's advantage (`[trainer.advantage]`), from the sample's
  rollout advantage (the orchestrator's advantage function), its reward, the KL-in-reward penalty
  and the critic's values;
- normalize: the one normalization of the run (`trainer.advantage.batch_normalize`): whitening
  over the step's model tokens on all ranks, in one pool or one per env; the orchestrator does none;
- d_t: per-token terms from the orchestrator (a teacher's distillation term, its weight applied),
  added after normalization so that the weight keeps its meaning.

Invariant: every function here returns new tensors and changes none of its inputs; advantages are
0 outside the loss mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from prime_rl.runtime import activity
from prime_rl.trainer.batch import PackedBatch
from prime_rl.trainer.parallel.dist import World, all_reduce_sum

STD_EPS = 1e-6


@dataclass(frozen=True)
class Credit:
    """One micro-batch and its estimator's advantages."""

    batch: PackedBatch
    estimate: torch.Tensor
    """[T] the estimator's advantages (0 outside the loss mask)."""


def whiten(items: list[Credit], mode: str, world: World) -> list[torch.Tensor]:
    """(A - mean) / (std + eps) of the estimates over the model tokens of every micro-batch on every
    rank: one pool ('all') or one per env ('env'). Moments are summed over ranks, so every rank uses
    the same."""
    names = sorted({e for c in items if not c.batch.source.filler for e in c.batch.env_names})
    if mode != "env":
        names = ["all"]
    elif world.distributed:
        gathered: list = [None] * world.world_size
        with activity.waiting("an all_gather of the env names", "trainer"):
            dist.all_gather_object(gathered, names)
        names = sorted({e for g in gathered for e in g})
    if not names:
        # Not one real sample on any rank (every rollout of the step filtered): only filler
        # micro-batches, which have no loss token to whiten.
        return [c.estimate for c in items]
    index = {e: i for i, e in enumerate(names)}
    dev = world.device
    moments = torch.zeros(len(names), 3, dtype=torch.float64, device=dev)
    rows_of = []
    for c in items:
        b = c.batch
        rows = b.per_token(torch.tensor([index.get(e, 0) for e in b.env_names], device=dev))
        counted = b.counted.to(torch.float64)  # each token once over the cp group
        a = torch.where(b.loss_mask, c.estimate.to(torch.float64), 0.0)
        moments.index_add_(0, rows, torch.stack([counted, a * counted, a * a * counted], dim=1))
        rows_of.append(rows)
    moments = all_reduce_sum(moments, world)
    n = moments[:, 0].clamp(min=1)
    mean = moments[:, 1] / n
    std = (moments[:, 2] / n - mean**2).clamp(min=0).sqrt()
    out = []
    for c, rows in zip(items, rows_of, strict=True):
        whitened = ((c.estimate - mean[rows]) / (std[rows] + STD_EPS)).to(c.estimate.dtype)
        out.append(torch.where(c.batch.loss_mask, whitened, c.estimate))
    return out


def compose(items: list[Credit], normalize: str, world: World) -> list[torch.Tensor]:
    """The advantages the loss sees, per micro-batch: A_t = normalize(estimate_t) + d_t."""
    estimates = [c.estimate for c in items] if normalize == "none" else whiten(items, normalize, world)
    return [
        a if (d := c.batch.token_advantages) is None else a + torch.where(c.batch.loss_mask, d, 0.0)
        for a, c in zip(estimates, items, strict=True)
    ]
