"""The critic of PPO with GAE: a causal LM's body with a scalar value head, and its clipped loss.

Invariant: the trainer aligns values to tokens like logprobs (`logprobs.py`): entry t is V of the
state before token t, read from the hidden state at t - 1, so the value and the logprob of a token
see the same context; entry 0 is 0. The model itself returns one value per position. On several ranks the critic is sharded with FSDP2 exactly like the
policy, and its gradients follow the same global-token normalization.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard

from prime_rl.trainer.config import CriticConfig, LoRAConfig, TrainedModelConfig
from prime_rl.trainer.model import (
    DTYPES,
    ModelLoadError,
    add_adapters,
    building,
    instantiate,
    place,
    set_attention,
)
from prime_rl.trainer.parallel.dist import World, all_reduce_sum


class ValueModel(torch.nn.Module):
    def __init__(self, body: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.body = body
        self.value_head = torch.nn.Linear(hidden_size, 1)
        # Seeded apart from the global RNG, so every rank and every run starts from the same head;
        # small (std 1 / (hidden + 1)), so first values are near 0 against rewards of order 1.
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            self.value_head.weight.copy_(torch.randn(1, hidden_size, generator=g) / (hidden_size + 1))
            self.value_head.bias.zero_()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **model_kwargs) -> torch.Tensor:
        """One value per position (of the state after it), shape [N], for packed positions of shape
        [N]; `model_kwargs` go to the body (the context-parallel shard)."""
        hidden = self.body(
            input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, **model_kwargs
        )
        # A copy, not a view: FSDP2 hooks backward onto the output, which a view could bypass.
        return self.value_head(hidden.last_hidden_state[0]).squeeze(-1).to(torch.float32, copy=True)


def load_critic(
    config: CriticConfig,
    policy: TrainedModelConfig,
    world: World,
    lora: LoRAConfig | None = None,
    seed: int = 0,
) -> ValueModel:
    """With `lora`, the body trains an adapter of its own (seeded apart from the policy's) and the
    value head is trained fully."""
    from transformers import AutoModel

    path = config.path or policy.name
    key = "trainer.critic.path" if config.path else "trainer.model.name (the critic starts from the policy)"
    try:
        with building(world):
            body = instantiate(AutoModel, path, policy.dtype, world)
    except Exception as e:
        raise ModelLoadError(
            f"{key} = '{path}': the critic could not be loaded with transformers: {type(e).__name__}: {' '.join(str(e).split())}"
        ) from None
    with building(world):
        if lora is not None:
            add_adapters(body, lora, seed + 1, key=key, name=path)
        critic = ValueModel(body, body.config.hidden_size).to(dtype=DTYPES[policy.dtype])
    place(critic, world)
    set_attention(body, policy.attention, world, key, path)
    if policy.activation_checkpointing:
        body.gradient_checkpointing_enable()
    if world.distributed:
        for layer in getattr(body, "layers", []):
            fully_shard(layer, mesh=world.mesh, reshard_after_forward=policy.reshard_after_forward)
        fully_shard(critic, mesh=world.mesh, reshard_after_forward=policy.reshard_after_forward)
    critic.train()
    return critic


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
