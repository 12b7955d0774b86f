"""Router replay: each MoE layer routes each token to the experts the sampler chose.

Invariant: only the choice of experts is replayed. The weights of the chosen experts come from this
model's own router at those experts (softmax over all experts, the chosen ones taken, renormalized
when the model renormalizes), so the router keeps its gradient and still learns. With routes equal
to the model's own top-k, replay computes exactly what the model computes without it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F


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
        chosen = routes[:, layer].long()
        logits = F.linear(hidden_states, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights = probs.gather(-1, chosen)
        if getattr(router, "norm_topk_prob", True):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(logits.dtype), chosen

    return forward


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
def replay(model: torch.nn.Module, routes: torch.Tensor | None) -> Iterator[None]:
    """Forwards of `model` inside route each token to `routes` ([T, layers, top-k]); None routes as
    the model does."""
    state = enable_replay(model)
    state.routes = routes
    try:
        yield
    finally:
        state.routes = None
