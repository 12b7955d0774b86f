"""Router replay: each MoE layer routes each token to the experts the sampler chose.

Invariant: only the choice of experts is replayed. The weights of the chosen experts come from this
model's own router at those experts (softmax over all experts, the chosen ones taken, renormalized
when the model renormalizes), so the router keeps its gradient and still learns. With routes equal
to the model's own top-k, replay computes exactly what the model computes without it.

While routes are given, each layer also counts the tokens whose own top-k (as a set) equals the
sampler's, whether the routes are applied or only compared (`agreement`): the measure of how far
the sampler's routing and the trainer's have drifted apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from prime_rl.trainer.parallel.dist import World, all_reduce_sum


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers, in layer order (transformers' `*TopKRouter` modules: Qwen3-MoE and
    its kin, which hold `weight` [experts, hidden], `top_k` and `norm_topk_prob`)."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k")]


def router_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, experts, top-k) of a MoE model's routing."""
    rs = routers(model)
    return len(rs), rs[0].num_experts, rs[0].top_k


class _Replay:
    """The routes of the forward under way: [T, layers, top-k] expert ids, or None (the model routes)."""

    routes: torch.Tensor | None = None
    apply: bool = True
    """Route by `routes` (replay), or only compare them with the model's own choice."""
    real: torch.Tensor | None = None
    """[T] bool: the tokens to count in `agreement` (None: all)."""
    agreement: torch.Tensor | None = None
    """[layers, 2] running (tokens whose top-k set agrees, tokens compared), on the device."""


def _replaying_forward(router: torch.nn.Module, layer: int, state: _Replay):
    own = router.forward

    def forward(hidden_states: torch.Tensor):
        routes = state.routes
        if routes is None:
            return own(hidden_states)
        hidden_states = hidden_states.reshape(-1, router.weight.shape[1])
        if routes.shape[0] != hidden_states.shape[0]:
            raise ValueError(
                f"router replay got routes for {routes.shape[0]} tokens, but layer {layer} routes "
                f"{hidden_states.shape[0]}"
            )
        sampler = routes[:, layer].long()
        if not state.apply:
            logits, weights, chosen = own(hidden_states)
            _count_agreement(state, layer, chosen, sampler)
            return logits, weights, chosen
        logits = F.linear(hidden_states, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        if state.agreement is not None:
            _count_agreement(state, layer, probs.topk(sampler.shape[-1], dim=-1).indices, sampler)
        weights = probs.gather(-1, sampler)
        if getattr(router, "norm_topk_prob", True):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), sampler

    return forward


def _count_agreement(state: _Replay, layer: int, own: torch.Tensor, sampler: torch.Tensor) -> None:
    if state.agreement is None:
        return
    with torch.no_grad():
        same = (own.sort(dim=-1).values == sampler.sort(dim=-1).values).all(dim=-1)
        real = state.real if state.real is not None else torch.ones_like(same)
        state.agreement[layer, 0] += (same & real).sum()
        state.agreement[layer, 1] += real.sum()


def enable_replay(model: torch.nn.Module) -> _Replay:
    """Let `model`'s routers replay routes given with `replay(model, routes)`; returns the holder."""
    state = getattr(model, "_prime_rl_replay", None)
    if state is None:
        state = _Replay()
        for i, router in enumerate(routers(model)):
            router.forward = _replaying_forward(router, i, state)
        model._prime_rl_replay = state
    return state


@contextmanager
def replay(
    model: torch.nn.Module,
    routes: torch.Tensor | None,
    apply: bool = True,
    real: torch.Tensor | None = None,
    agreement: torch.Tensor | None = None,
) -> Iterator[None]:
    """Forwards of `model` inside route each token to `routes` ([T, layers, top-k]); None routes as
    the model does. With `apply=False` the model routes itself and the routes are only compared.
    `agreement` ([layers, 2], optional) accumulates the comparison over the `real` tokens."""
    state = enable_replay(model)
    state.routes, state.apply, state.real, state.agreement = routes, apply, real, agreement
    try:
        yield
    finally:
        state.routes, state.real, state.agreement = None, None, None


def agreement_metrics(agreement: torch.Tensor, world: World) -> dict[str, float]:
    """Per layer, the share of compared tokens whose top-k set the trainer's router and the
    sampler's agree on (summed over all ranks first), and the mean over layers; {} when no token
    carried routes."""
    rows = world.host(all_reduce_sum(agreement, world))
    if not any(total for _, total in rows):
        return {}
    out = {
        f"moe/route_agreement/layer_{i}": same / total if total else 0.0
        for i, (same, total) in enumerate(rows)
    }
    out["moe/route_agreement"] = sum(out.values()) / len(out)
    return out
