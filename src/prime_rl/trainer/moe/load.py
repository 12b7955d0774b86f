"""Expert load: how evenly a MoE model's routers spread the tokens of a step over their experts, and
the load-balancing loss that evens it.

Invariant: counts are kept on the device as fixed-shape tensors ([layers, experts], one scatter-add
per router call) and reach the host once per step, after one sum over all ranks, so the metric costs
no host sync per micro-batch. Only the tokens of samples count (not the filler micro-batches that
even out the ranks, nor context parallelism's padding), so the metric and the loss are the same
whatever the dp x cp x ep split.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from prime_rl.trainer.moe.replay import routers
from prime_rl.trainer.parallel.dist import World, all_reduce_sum


@dataclass
class Routing:
    """What the routers did in the forwards of one micro-batch: the step's running counts, and this
    micro-batch's router logits (kept with their graph, for the load-balancing loss)."""

    counts: torch.Tensor
    top_k: int
    real: torch.Tensor | None = None
    """[T] bool: the routed positions that belong to samples (None: all of them)."""
    logits: list[torch.Tensor] = field(default_factory=list)

    def balance_loss(self) -> torch.Tensor:
        """Switch Transformer's load-balancing loss of this micro-batch, averaged over layers."""
        terms = []
        for logits in self.logits:
            if self.real is not None:
                logits = logits[self.real]
            experts = logits.shape[-1]
            probs = torch.softmax(logits.float(), dim=-1)
            chosen = probs.topk(self.top_k, dim=-1).indices
            share = torch.zeros(experts, device=logits.device).index_add_(
                0, chosen.reshape(-1), torch.ones(chosen.numel(), device=logits.device)
            ) / max(chosen.numel(), 1)
            terms.append(experts * (share * probs.mean(dim=0)).sum())
        return torch.stack(terms).mean()


@contextmanager
def recording_routes(
    model: torch.nn.Module, counts: torch.Tensor, real: torch.Tensor | None = None
) -> Iterator[Routing]:
    """Add the experts each token is routed to in forwards inside to `counts` ([layers, experts]),
    and collect the router logits. `real` ([T] bool): the positions to count (default: all)."""
    found = routers(model)
    routing = Routing(counts, found[0].top_k, real)
    handles = []
    for layer, router in enumerate(found):

        def hook(module, args, output, layer=layer):
            chosen = output[2].detach()
            ones = torch.ones_like(chosen, dtype=counts.dtype)
            if real is not None:
                ones = ones * real[:, None]
            counts[layer].index_add_(0, chosen.reshape(-1), ones.reshape(-1))
            routing.logits.append(output[0])

        handles.append(router.register_forward_hook(hook))
    try:
        yield routing
    finally:
        for h in handles:
            h.remove()


def new_counts(model: torch.nn.Module, device: torch.device) -> torch.Tensor | None:
    """Zero counts for `model`'s routers, or None for a dense model."""
    found = routers(model)
    if not found:
        return None
    return torch.zeros(len(found), found[0].num_experts, dtype=torch.float64, device=device)


def load_metrics(counts: torch.Tensor, world: World) -> dict[str, float]:
    """Per layer, the busiest expert's tokens over the mean (1.0: perfectly even; the number of
    experts: every token on one expert), and their mean over layers. Summed over all ranks first."""
    per_layer = world.host(all_reduce_sum(counts, world))
    out = {}
    for i, row in enumerate(per_layer):
        mean = sum(row) / len(row)
        out[f"moe/load_max_over_mean/layer_{i}"] = max(row) / mean if mean > 0 else 0.0
    if out:
        out["moe/load_max_over_mean"] = sum(out.values()) / len(out)
    return out
