"""Context parallelism: the tokens of one packed micro-batch split across the `cp` ranks of a group.

Split: the micro-batch's T positions are cut into 2 * cp contiguous chunks; rank r holds chunks r and
2 * cp - 1 - r (an early and a late one), so under causal attention every rank has about the same
work. Ranks are padded to one length L (at most one or two positions); padding attends only to
padding and its outputs are dropped.

Attention: each layer all-gathers the keys and values of the group (after RoPE, which used the real
position ids) and attends its own queries to them under a mask that lets a query see the keys of
its own sample at or before its own place, so samples never attend to each other, exactly as
without cp. In backward, the gathered keys' and values' gradients are reduce-scattered: summed over
the group, each rank receiving its own slice. Both are single-buffer collectives that nccl and gloo
have (`all_gather_into_tensor`, `reduce_scatter_tensor`), so CPU tests run the GPU's code.

Invariant: every per-position value a rank computes (logprobs, entropies, values) is gathered back
to the full micro-batch with `SequenceShard.gather`, whose backward sums the group's gradients, so
the losses see the same full-length tensors as without cp and need no change. Each rank then adds
to its loss only the tokens it *owns* (those predicted from its positions), so the group's losses
sum to the micro-batch's loss once. With cp = 1 the shard is the whole micro-batch and every
method is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from prime_rl.trainer.rl.returns import sample_index


def _all_gather_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    # torch 2.13 renamed the single-buffer collectives; older releases have only the old names.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, op=dist.ReduceOp.SUM, group=group)


ATTENTION = "prime_rl_cp"
"""The attention implementation name registered with transformers."""

SHARD_KWARG = "cp_shard"
"""The keyword under which a model call hands the shard down to every attention layer."""


@dataclass(frozen=True)
class SequenceShard:
    """This rank's share of one packed micro-batch of `length` positions."""

    length: int
    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    index: torch.Tensor | None = None
    """[L] the micro-batch position of each local position; padding holds `length` (out of range)."""
    mask: torch.Tensor | None = None
    """[L, size * L] bool: which gathered keys each local query may attend to."""

    @property
    def split(self) -> bool:
        return self.size > 1

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The local positions of a per-position tensor of shape [T, ...] (padding gets 0)."""
        if not self.split:
            return full
        padded = torch.cat([full, full.new_zeros(1, *full.shape[1:])])
        return padded[self.index]

    def owned_tokens(self, device: torch.device) -> torch.Tensor:
        """[T] bool: the tokens whose loss and metrics this rank counts, those predicted from its
        positions (token t from position t - 1); each token is owned by exactly one rank."""
        if not self.split:
            return torch.ones(self.length, dtype=torch.bool, device=device)
        positions = torch.zeros(self.length + 1, dtype=torch.bool, device=device)
        positions[self.index] = True
        return torch.cat([positions.new_zeros(1), positions[: self.length - 1]])

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """A per-position tensor [L] of every rank, put back together as [T] (differentiable)."""
        if not self.split:
            return local
        everything = _GatherSum.apply(local, self.group, self.size, self.rank, 0)  # [size * L]
        full = local.new_zeros(self.length + 1)
        full = full.index_copy(0, self.keys(local.device), everything)  # padding lands on the extra slot
        return full[: self.length]

    def keys(self, device: torch.device) -> torch.Tensor:
        """[size * L] micro-batch position of each gathered entry, in rank order (padding: `length`)."""
        return _all_indices(self.length, self.size, device).flatten()

    def model_kwargs(self) -> dict:
        """Keyword arguments of a model call that make its attention layers attend across the group."""
        return {SHARD_KWARG: self} if self.split else {}


def shard_micro_batch(
    sample_lens: list[int], size: int, rank: int, group, device: torch.device
) -> SequenceShard:
    """This rank's shard of a micro-batch made of samples of `sample_lens` tokens."""
    length = sum(sample_lens)
    if size == 1:
        return SequenceShard(length)
    indices = _all_indices(length, size, device)  # [size, L]
    sample = sample_index(sample_lens, device)
    # Padding is a sample of its own (-1) and sits after every real position, so each padding query
    # has at least itself to attend to (an all-masked row would give NaN).
    sample = torch.cat([sample, sample.new_full((1,), -1)])
    pad_order = torch.arange(indices.numel(), device=device).view_as(indices) + length
    order = torch.where(indices < length, indices, pad_order)
    q, k = indices[rank], indices.flatten()
    q_order, k_order = order[rank], order.flatten()
    mask = (sample[q][:, None] == sample[k][None, :]) & (k_order[None, :] <= q_order[:, None])
    return SequenceShard(length, size, rank, group, q, mask)


def _all_indices(length: int, size: int, device: torch.device) -> torch.Tensor:
    """[size, L]: rank r's positions (chunks r and 2 * size - 1 - r of 2 * size), padded with `length`."""
    chunks = torch.arange(length, device=device).tensor_split(2 * size)
    per_rank = [torch.cat([chunks[r], chunks[2 * size - 1 - r]]) for r in range(size)]
    width = max(len(p) for p in per_rank)
    return torch.stack([F.pad(p, (0, width - len(p)), value=length) for p in per_rank])


class _GatherSum(torch.autograd.Function):
    """All-gather along `dim` in rank order; backward: a reduce-scatter, the gradients of all ranks
    summed, each rank receiving its own slice. Both collectives work on dim 0 of one buffer, so
    `dim` is moved there and back."""

    @staticmethod
    def forward(ctx, x, group, size: int, rank: int, dim: int):
        ctx.group, ctx.size, ctx.dim = group, size, dim
        local = x.movedim(dim, 0).contiguous()
        out = local.new_empty((size * local.shape[0], *local.shape[1:]))
        _all_gather_single(out, local, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad):
        full = grad.movedim(ctx.dim, 0).contiguous()
        out = full.new_empty((full.shape[0] // ctx.size, *full.shape[1:]))
        _reduce_scatter_single(out, full, ctx.group)
        return out.movedim(0, ctx.dim), None, None, None, None


def cp_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function (query [B, Hq, L, D], key/value [B, Hkv, L, D]): this rank's
    queries against the whole group's keys and values."""
    shard: SequenceShard | None = kwargs.get(SHARD_KWARG)
    if shard is None:
        raise RuntimeError(
            "the model's attention is set up for context parallelism, but this call passed no shard "
            f"('{SHARD_KWARG}' keyword): run it through the trainer's micro-batch path"
        )
    kv = _GatherSum.apply(torch.stack([key, value]), shard.group, shard.size, shard.rank, 3)
    k, v = kv[0], kv[1]
    if k.shape[1] != query.shape[1]:
        # Grouped-query attention with a mask: CUDA's fused kernels take a mask only with as many k/v
        # heads as query heads (else the math kernel holds every head's [L, S] probabilities).
        k = k.repeat_interleave(query.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(query.shape[1] // v.shape[1], dim=1)
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=shard.mask, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def cp_attention_problem(model: torch.nn.Module) -> str | None:
    """Why this model's attention cannot be split across ranks, or None when it can."""
    if not getattr(type(model), "_supports_attention_backend", False):
        return f"{type(model).__name__} does not take a pluggable attention function from transformers"
    config = model.config
    if "sliding_attention" in (getattr(config, "layer_types", None) or []) or getattr(
        config, "use_sliding_window", False
    ):
        return "it uses sliding-window attention, which the context-parallel mask does not implement"
    return None


def enable_cp_attention(model: torch.nn.Module) -> None:
    """Route the model's attention layers through `cp_attention` (registered with transformers once)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, cp_attention)
    model.set_attn_implementation(ATTENTION)
