"""A training step's mixture-of-experts bookkeeping, in one place for the trainer's step: the expert
load counts, router replay of the routes a micro-batch carries (and its agreement counts), and the
load-balancing loss.

Invariant: everything is kept on the device during the step (no host sync per micro-batch) and
reaches the host once, in `metrics`, after one sum over all ranks; only sample tokens count
(`PackedBatch.real`), so the figures do not depend on the dp x cp x ep layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from prime_rl.trainer.moe.load import Routing, load_metrics, new_counts, recording_routes
from prime_rl.trainer.moe.replay import agreement_metrics, replay
from prime_rl.trainer.parallel.dist import World, all_reduce_sum


@dataclass
class MoEStep:
    model: torch.nn.Module
    replay_routes: bool
    aux_loss_coef: float
    world: World
    counts: torch.Tensor
    """[layers, experts] tokens routed to each expert."""
    agreement: torch.Tensor
    """[layers, 2] (tokens whose top-k agrees with the sampler's, tokens compared)."""
    aux_sum: torch.Tensor

    @classmethod
    def start(
        cls, model: torch.nn.Module, replay_routes: bool, aux_loss_coef: float, world: World
    ) -> MoEStep | None:
        """The bookkeeping of a step of `model`, or None for a dense model."""
        counts = new_counts(model, world.device)
        if counts is None:
            return None
        return cls(
            model,
            replay_routes,
            aux_loss_coef,
            world,
            counts,
            counts.new_zeros(counts.shape[0], 2),
            world.scalars(0.0)[0],
        )

    @contextmanager
    def forward(self, real: torch.Tensor, routes: torch.Tensor | None) -> Iterator[Routing]:
        """Around one micro-batch's forward: count the routes of its `real` positions and replay
        (or compare) the sampler's `routes` when it carries them."""
        replaying = (
            replay(self.model, routes, self.replay_routes, real, self.agreement)
            if routes is not None
            else nullcontext()
        )
        with recording_routes(self.model, self.counts, real) as routing, replaying:
            yield routing

    def aux_loss(self, routing: Routing, weight: torch.Tensor) -> torch.Tensor | None:
        """The micro-batch's load-balancing loss term (`weight`: its share of the step's loss
        tokens), to add to its loss; None when the coefficient is 0 (it is logged anyway)."""
        aux = routing.balance_loss() * weight
        self.aux_sum = self.aux_sum + aux.detach()
        return self.aux_loss_coef * aux if self.aux_loss_coef > 0 else None

    def metrics(self) -> dict[str, float]:
        return {
            **load_metrics(self.counts, self.world),
            **agreement_metrics(self.agreement, self.world),
            "moe/aux_loss": self.world.host(all_reduce_sum(self.aux_sum, self.world)),
        }
