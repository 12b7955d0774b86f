"""The trainer's mixture-of-experts settings (`[trainer.moe]`), next to the code they configure."""

from __future__ import annotations

from pydantic import Field

from prime_rl.config import BaseConfig


class MoEConfig(BaseConfig):
    """Mixture-of-experts models (ignored for dense ones): router replay and the load-balancing loss."""

    aux_loss_coef: float = Field(default=0.0, ge=0)
    """Weight of the load-balancing loss added to the training loss: per layer, experts x the sum over
    experts of (share of the token's top-k slots routed to it) x (its mean router probability), as the
    Switch Transformer's; 1.0 when the load is even. Averaged over layers, weighted by each
    micro-batch's share of the step's loss tokens. 0: off (the metric `moe/aux_loss` is logged
    anyway)."""

    replay: bool = True
    """Router replay: when the micro-batches carry the sampler's routed experts (the orchestrator's
    `return_routes`), route every token to the experts the sampler chose, with this router's own
    weights at them (so the router still learns). False: the trainer's routers choose, and the
    routes only measure agreement (`moe/route_agreement`)."""
