"""The critic of PPO with GAE: a causal LM's body with a scalar value head, and its clipped loss.

Invariant: the trainer aligns values to tokens like logprobs (`logprobs.py`): entry t is V of the
state before token t, read from the hidden state at t - 1, so the value and the logprob of a token
see the same context; entry 0 is 0. The model itself returns one value per position. On several ranks the critic is sharded with FSDP2 exactly like the
policy, and its gradients follow the same global-token normalization.
"""

from __future__ import annotations

import torch

from prime_rl.trainer.config import CriticConfig, LoRAConfig, TrainedModelConfig
from prime_rl.trainer.head import ScalarHead
from prime_rl.trainer.model import build_model
from prime_rl.trainer.parallel.dist import World, all_reduce_sum


def value_head(body: torch.nn.Module) -> ScalarHead:
    """The body with a value head: small (std 1 / (hidden + 1)), so first values are near 0 against
    rewards of order 1, and its bias 0."""
    hidden = body.config.hidden_size
    return ScalarHead(body, hidden, bias=True, seed=0, std=1.0 / (hidden + 1))


def load_critic(
    config: CriticConfig,
    policy: TrainedModelConfig,
    world: World,
    lora: LoRAConfig | None = None,
    seed: int = 0,
) -> ScalarHead:
    """Placed and sharded like the policy; with `lora`, the body trains an adapter of its own (seeded
    apart from the policy's) and the value head is trained fully."""
    key = "trainer.critic.path" if config.path else "trainer.model.name (the critic starts from the policy)"
    return build_model(
        policy, world, name=config.path, key=key, role="the critic", lora=lora, seed=seed + 1, head=value_head
    )


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss 0.5 * max((V - R)^2, (V_clipped - R)^2), per-token bool: the clipped term won),
    with V_clipped = V_old + clamp(V - V_old, -clip, clip); both 0 outside the mask."""
    clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    plain, bounded = (values - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * torch.maximum(plain, bounded) * mask, (bounded > plain) & mask


def explained_variance(prepared: list, world: World) -> float:
    """1 - Var(returns - old values) / Var(returns) over the step's model tokens on all ranks (of
    the trainer's prepared micro-batches: their masks, returns and old values)."""
    sums = world.scalars(0.0, 0.0, 0.0, 0.0, 0.0)
    for p in prepared:
        mask = p.batch.counted
        w = mask.double()
        r, v = p.returns.double() * w, p.old_values.double() * w
        d = r - v
        sums += torch.stack([w.sum(), r.sum(), (r * r).sum(), d.sum(), (d * d).sum()])
    n, rs, rss, ds, dss = world.host(all_reduce_sum(sums, world))
    if n < 2:
        return float("nan")
    var_r = rss / n - (rs / n) ** 2
    var_d = dss / n - (ds / n) ** 2
    return 1.0 - var_d / var_r if var_r > 1e-12 else float("nan")
