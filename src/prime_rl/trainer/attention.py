"""Packed attention: each sample of a packed micro-batch attends causally to itself only, at a cost
that grows with the sum over samples of L², never with the micro-batch's T².

Invariant: the samples are read from `position_ids` alone (a sample starts where its position is 0,
as `transport/packing.py` lays them out), so no [T, T] mask is ever built. Every mechanism here
computes the same function as causal attention under the block-diagonal mask, and each is a
transformers attention function: query [1, Hq, T, D], key/value [1, Hkv, T, D] in, [1, T, Hq, D] out.

- `per_sample`: one `scaled_dot_product_attention(is_causal=True)` per sample. Runs everywhere,
  backward included (FlexAttention has no CPU backward).
- `flex`: FlexAttention with a block mask of the samples (CUDA; compiled by Triton).
- `varlen`: torch's variable-length flash attention (CUDA only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

MECHANISMS = ("per_sample", "flex", "varlen")


def sample_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of the packed samples: [0, start_1, ..., T] (int32, on the positions' device)."""
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    end = torch.tensor([pos.numel()], device=pos.device, dtype=starts.dtype)
    return torch.cat([starts, end]).to(torch.int32)


def _expand_kv(query: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    return kv if kv.shape[1] == query.shape[1] else kv.repeat_interleave(query.shape[1] // kv.shape[1], dim=1)


def per_sample_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    bounds = sample_starts(kwargs["position_ids"]).tolist()
    key, value = _expand_kv(query, key), _expand_kv(query, value)
    outs = []
    # Runs of equal-length samples go through one batched call, so many short samples cost few launches.
    i = 0
    while i < len(bounds) - 1:
        length = bounds[i + 1] - bounds[i]
        j = i + 1
        while j < len(bounds) - 1 and bounds[j + 1] - bounds[j] == length:
            j += 1
        a, b, n = bounds[i], bounds[j], j - i
        q, k, v = (t[0, :, a:b].unflatten(1, (n, length)).transpose(0, 1) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling)
        outs.append(o.transpose(0, 1).flatten(1, 2))
        i = j
    out = torch.cat(outs, dim=1)[None]
    return out.transpose(1, 2).contiguous(), None


_BLOCK_MASKS: dict = {}


def _block_mask(position_ids: torch.Tensor, length: int):
    from torch.nn.attention.flex_attention import create_block_mask

    # Every layer of one forward asks for the same mask: build it once. The address alone is no key (a
    # freed tensor's memory is reused), so the positions it was built from are compared too.
    key = (position_ids.data_ptr(), length, position_ids.device)
    cached = _BLOCK_MASKS.get(key)
    if cached is None or not torch.equal(cached[0], position_ids):
        _BLOCK_MASKS.clear()
        bounds = sample_starts(position_ids)
        doc = torch.zeros(length, dtype=torch.int32, device=position_ids.device)
        doc[bounds[1:-1].long()] = 1
        doc = doc.cumsum(0)

        def causal_same_sample(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)

        # Compiled, the mask is built block by block; eager, it would hold all T x T booleans at once.
        mask = create_block_mask(
            causal_same_sample, None, None, length, length, device=position_ids.device, _compile=True
        )
        _BLOCK_MASKS[key] = (position_ids.clone(), mask)
    return _BLOCK_MASKS[key][1]


_FLEX = None


def flex_attention_fn(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    global _FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    mask = _block_mask(kwargs["position_ids"], query.shape[2])
    gqa = key.shape[1] != query.shape[1]
    out = _FLEX(query, key, value, block_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def varlen_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    cu = sample_starts(kwargs["position_ids"])
    longest = int((cu[1:] - cu[:-1]).max())
    params = inspect.signature(varlen_attn).parameters
    # torch <= 2.11 spells causal `is_causal`; later ones a (left, right) window, right = 0.
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        causal["enable_gqa"] = key.shape[1] != query.shape[1]
    else:
        key, value = _expand_kv(query, key), _expand_kv(query, value)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **causal)
    return out[None], None


FUNCTIONS = {"per_sample": per_sample_attention, "flex": flex_attention_fn, "varlen": varlen_attention}


def use_packed_attention(model: torch.nn.Module, mechanism: str) -> None:
    """Route `model`'s attention through `mechanism` (registered with transformers under
    `prime_rl_<mechanism>`)."""
    from transformers import AttentionInterface

    name = f"prime_rl_{mechanism}"
    AttentionInterface.register(name, FUNCTIONS[mechanism])
    model.set_attn_implementation(name)
