"""Packed attention: each sample of a packed micro-batch attends causally to itself only, at a cost
that grows with the sum over samples of L², never with the micro-batch's T².

Invariant: no [T, T] mask is ever built. Every mechanism computes causal attention under the
block-diagonal mask of the samples, and each is a transformers attention function: query
[1, Hq, T, D], key/value [1, Hkv, T, D] in, [1, T, Hq, D] out.

- `packed` (default, CPU and CUDA, backward included): an `AttentionPlan` cuts the queries into
  segments (a sample, or under context parallelism the part of a sample a rank holds, with the
  earlier keys of that sample). Segments of similar length are padded to one length and go through
  one batched `scaled_dot_product_attention(is_causal=True)`, so hundreds of short samples cost a
  few kernel calls. Padding sits after a segment's real rows, where causal attention keeps it from
  every real query; its outputs are dropped. A segment whose keys start before its queries (a
  sample cut by context parallelism) gets a mask of its own [Lq, Lk], never one of the micro-batch.
- `flex`: FlexAttention with a block mask of the samples (CUDA only; compiled by Triton; no backward
  on the CPU).
- `varlen`: torch's variable-length flash attention (CUDA only, 16-bit floats).

The trainer builds the plan once per micro-batch from its sample lengths and hands it to every
layer under the `packed_attention` keyword; a direct model call without it reads the samples from
`position_ids` (a sample starts where its position is 0, as `transport/packing.py` lays them out).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

PLAN_KWARG = "packed_attention"
"""The keyword under which a model call hands the `AttentionPlan` down to every attention layer."""

BUCKET_FILL = 0.8
"""Segments share a padded call when their length is at least this fraction of its longest: at
most (1 / 0.8)² = 1.56x the attention work of unpadded calls, usually far less."""

SHORT = 16
"""Segments this short all share one call: padding them costs less than another kernel launch."""

ALONE = 512
"""Segments this long get a call each, on views of the rows: their work dwarfs a kernel launch, and
batching them would copy their queries, keys and values into padded buffers."""


@dataclass(frozen=True)
class Segment:
    """Queries at local rows `q_start + i` (i < q_len) attend to key rows `keys[: offset + i + 1]`:
    a sample's queries and the keys of that sample up to each query (offset = keys before the first
    query, 0 for a whole sample)."""

    q_start: int
    q_len: int
    keys: np.ndarray  # [offset + q_len] key rows

    @property
    def offset(self) -> int:
        return len(self.keys) - self.q_len


@dataclass(frozen=True)
class Bucket:
    """Segments attended in one call: `q_index` [n, Lq] and `k_index` [n, Lk] gather their rows
    (padding repeats a segment's last row); `mask` [n, 1, Lq, Lk] or None for plain causal."""

    q_index: torch.Tensor
    k_index: torch.Tensor
    mask: torch.Tensor | None
    k_local: torch.Tensor | None = None
    """Under context parallelism, for a segment with received keys: the local key rows it uses.
    Its keys are then cat(local[k_local], received)[k_index], never a copy of all local rows."""
    k_received: torch.Tensor | None = None
    """Set when a segment's keys are received rows (these) followed by its own query rows, the
    usual case: its keys are then cat(received[k_received], own rows), with no gather of local rows."""
    rows: tuple[int, int, int] | None = None
    """(start, segments, length) when the bucket is whole segments of one length lying end to end
    in the rows, each its own keys: then it is attended on views, without gathering copies."""


@dataclass(frozen=True)
class AttentionPlan:
    """How one rank's `length` query rows attend: the buckets, where each query row's output lands in
    their concatenation (`out_rows`), and, under context parallelism, `exchange`, which takes the
    local key and value rows ([L, Hkv, D] each) and returns the rows received from the other ranks
    (key rows L, L + 1, ... in the segments)."""

    length: int
    buckets: tuple[Bucket, ...]
    out_rows: torch.Tensor | None
    """None when the buckets' outputs are already in row order."""
    cu_seqlens: torch.Tensor | None = None
    """[samples + 1] sample bounds when the rank holds whole samples (for flex and varlen)."""
    exchange: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    segments: tuple[Segment, ...] = ()
    """What the buckets attend, kept on the host (for checks and tests)."""


def sample_segments(sample_lens: list[int]) -> list[Segment]:
    """Whole samples laid end to end: each attends to itself (key rows = query rows)."""
    segments, start = [], 0
    for n in sample_lens:
        segments.append(Segment(start, n, np.arange(start, start + n)))
        start += n
    return segments


def build_plan(
    segments: list[Segment],
    length: int,
    device: torch.device,
    cu_seqlens: list[int] | None = None,
    exchange: Callable | None = None,
) -> AttentionPlan:
    """Bucket `segments` (which cover query rows 0..length-1 once each) into padded calls. Key rows
    from `length` on are received ones (context parallelism)."""
    whole = sorted((s for s in segments if s.offset == 0), key=lambda s: -s.q_len)
    groups: list[list[Segment]] = []
    for s in whole:
        head = groups[-1][0].q_len if groups else 0
        if groups and head < ALONE and (s.q_len >= BUCKET_FILL * head or head <= SHORT):
            groups[-1].append(s)
        else:
            groups.append([s])
    groups += [[s] for s in segments if s.offset > 0]
    # In row order (within a bucket too): when every bucket is a run of rows, the outputs are
    # already in place and need no gather.
    groups = sorted((sorted(g, key=lambda s: s.q_start) for g in groups), key=lambda g: g[0].q_start)
    out_rows = np.empty(length, dtype=np.int64)
    buckets, base = [], 0
    for group in groups:
        lq = max(s.q_len for s in group)
        lk = max(len(s.keys) for s in group)
        step = np.arange(lq)
        q_index = np.stack([s.q_start + np.minimum(step, s.q_len - 1) for s in group])
        k_index = np.stack([s.keys[np.minimum(np.arange(lk), len(s.keys) - 1)] for s in group])
        for i, s in enumerate(group):
            out_rows[s.q_start : s.q_start + s.q_len] = base + i * lq + np.arange(s.q_len)
        base += len(group) * lq
        mask = k_local = k_received = None
        if group[0].offset > 0:
            s = group[0]
            mask = np.arange(lk)[None, :] <= np.arange(lq)[:, None] + s.offset
            mask = torch.as_tensor(mask, device=device)[None, None]
            if (s.keys >= length).any():
                local = np.unique(s.keys[s.keys < length])
                k_index = np.where(
                    s.keys < length, np.searchsorted(local, s.keys), len(local) + s.keys - length
                )[None]
                k_local = _tensor(local, device)
                if (s.keys[: s.offset] >= length).all() and np.array_equal(
                    s.keys[s.offset :], s.q_start + step
                ):
                    k_received = _tensor(s.keys[: s.offset] - length, device)
        rows = None
        first = group[0]
        span = np.arange(len(group) * lq)
        if (
            all(s.q_len == lq and s.offset == 0 for s in group)
            and np.array_equal(q_index.reshape(-1), first.q_start + span)
            and np.array_equal(k_index.reshape(-1), first.q_start + span)
        ):
            rows = (first.q_start, len(group), lq)
        buckets.append(
            Bucket(_tensor(q_index, device), _tensor(k_index, device), mask, k_local, k_received, rows)
        )
    cu = _tensor(np.asarray(cu_seqlens), device).to(torch.int32) if cu_seqlens is not None else None
    identity = base == length and np.array_equal(out_rows, np.arange(length))
    out = None if identity else _tensor(out_rows, device)
    return AttentionPlan(length, tuple(buckets), out, cu, exchange, tuple(segments))


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(a, dtype=np.int64), device=device)


def plan_for_samples(sample_lens: list[int], device: torch.device) -> AttentionPlan:
    """The plan of whole samples packed end to end (no context parallelism)."""
    cu = np.concatenate([[0], np.cumsum(sample_lens)]).tolist()
    return build_plan(sample_segments(sample_lens), int(sum(sample_lens)), device, cu_seqlens=cu)


def sample_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """cu_seqlens of the packed samples: [0, start_1, ..., T] (int32, on the positions' device)."""
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        starts = torch.cat([starts.new_zeros(1), starts])
    end = torch.tensor([pos.numel()], device=pos.device, dtype=starts.dtype)
    return torch.cat([starts, end]).to(torch.int32)


_PLANS: dict = {}


def plan_from_positions(position_ids: torch.Tensor) -> AttentionPlan:
    """The plan of a call that brought none: samples read from the positions, built once for all
    the layers of one forward. The address alone is no key (a freed tensor's memory is reused), so
    the positions it was built from are compared too."""
    key = (position_ids.data_ptr(), position_ids.numel(), position_ids.device)
    cached = _PLANS.get(key)
    if cached is None or not torch.equal(cached[0], position_ids):
        _PLANS.clear()
        bounds = sample_starts(position_ids).tolist()
        lens = [b - a for a, b in itertools.pairwise(bounds)]
        _PLANS[key] = (position_ids.clone(), plan_for_samples(lens, position_ids.device))
    return _PLANS[key][1]


def _plan(kwargs) -> AttentionPlan:
    plan = kwargs.get(PLAN_KWARG)
    return plan if plan is not None else plan_from_positions(kwargs["position_ids"])


def packed_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    plan = _plan(kwargs)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [L, H, D] views
    k_got, v_got = plan.exchange(k, v) if plan.exchange is not None else (None, None)
    gqa = k.shape[1] != q.shape[1]
    # When the buckets cover the rows in order, each takes its own piece of one split: in backward the
    # pieces' gradients are put together once (a slice or gather per bucket would each build a
    # full-size gradient), and the outputs go straight into one buffer.
    in_place = plan.out_rows is None
    if in_place:
        sizes = [b.q_index.numel() for b in plan.buckets]
        pieces = zip(*(x.split(sizes, dim=2) for x in (query, key, value)), strict=True)
        out = q.new_empty(q.shape)
    else:
        pieces = [(None, None, None)] * len(plan.buckets)
    outs, row = [], 0
    sdpa = partial(F.scaled_dot_product_attention, dropout_p=dropout, scale=scaling)
    for b, (qp, kp, vp) in zip(plan.buckets, pieces, strict=True):
        if b.rows is not None:
            start, n, lq = b.rows
            if qp is None:
                qp, kp, vp = (x[:, :, start : start + n * lq] for x in (query, key, value))
            qb, kb, vb = (x[0].unflatten(1, (n, lq)).transpose(0, 1) for x in (qp, kp, vp))
        elif b.k_received is not None and qp is not None:
            qb = qp
            kb, vb = (
                torch.cat([got[b.k_received].transpose(0, 1)[None], own], 2)
                for got, own in ((k_got, kp), (v_got, vp))
            )
        elif b.k_local is not None:
            qb = q[b.q_index].transpose(1, 2)
            kb, vb = (
                torch.cat([x[b.k_local], got])[b.k_index].transpose(1, 2)
                for x, got in ((k, k_got), (v, v_got))
            )
        else:
            qb, kb, vb = (x[i].transpose(1, 2) for x, i in ((q, b.q_index), (k, b.k_index), (v, b.k_index)))
        if b.mask is not None and gqa:
            # CUDA's fused kernels take a mask only with as many k/v heads as query heads.
            kb = kb.repeat_interleave(qb.shape[1] // kb.shape[1], dim=1)
            vb = vb.repeat_interleave(qb.shape[1] // vb.shape[1], dim=1)
        o = sdpa(qb, kb, vb, attn_mask=b.mask, is_causal=b.mask is None, enable_gqa=gqa and b.mask is None)
        o = o.transpose(1, 2)  # [n, Lq, Hq, D]
        if in_place:
            out[row : row + o.shape[0] * o.shape[1]].view(o.shape).copy_(o)
            row += o.shape[0] * o.shape[1]
        else:
            outs.append(o.flatten(0, 1))
    if not in_place:
        out = (torch.cat(outs) if len(outs) > 1 else outs[0])[plan.out_rows]
    if k_got is not None and all(b.k_local is None for b in plan.buckets):
        # This rank received no key, yet the exchange's backward is a collective that every rank of
        # the group must enter: the output depends on what arrived, so autograd runs it here too.
        out[:1] += (k_got.sum() + v_got.sum()) * 0
    return out[None], None


_BLOCK_MASKS: dict = {}


def _block_mask(cu: torch.Tensor, length: int):
    from torch.nn.attention.flex_attention import create_block_mask

    key = (cu.data_ptr(), length, cu.device)
    cached = _BLOCK_MASKS.get(key)
    if cached is None or not torch.equal(cached[0], cu):
        _BLOCK_MASKS.clear()
        doc = torch.zeros(length, dtype=torch.int32, device=cu.device)
        doc[cu[1:-1].long()] = 1
        doc = doc.cumsum(0)

        def causal_same_sample(b, h, q, kv):
            return (doc[q] == doc[kv]) & (q >= kv)

        # Compiled, the mask is built block by block; eager, it would hold all T x T booleans at once.
        mask = create_block_mask(
            causal_same_sample, None, None, length, length, device=cu.device, _compile=True
        )
        _BLOCK_MASKS[key] = (cu.clone(), mask)
    return _BLOCK_MASKS[key][1]


_FLEX = None


def flex_attention_fn(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    global _FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    mask = _block_mask(_plan(kwargs).cu_seqlens, query.shape[2])
    gqa = key.shape[1] != query.shape[1]
    out = _FLEX(query, key, value, block_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def varlen_attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, **kwargs):
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    cu = _plan(kwargs).cu_seqlens
    longest = int((cu[1:] - cu[:-1]).max())
    params = inspect.signature(varlen_attn).parameters
    # torch <= 2.11 spells causal `is_causal`; later ones a (left, right) window, right = 0.
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        causal["enable_gqa"] = key.shape[1] != query.shape[1]
    elif key.shape[1] != query.shape[1]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, H, D]
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling, **causal)
    return out[None], None


FUNCTIONS = {"packed": packed_attention, "flex": flex_attention_fn, "varlen": varlen_attention}


def model_problem(model: torch.nn.Module) -> str | None:
    """Why this model's attention cannot be replaced by packed attention, or None when it can."""
    if not getattr(type(model), "_supports_attention_backend", False):
        return f"{type(model).__name__} does not take a pluggable attention function from transformers"
    config = model.config
    if "sliding_attention" in (getattr(config, "layer_types", None) or []) or getattr(
        config, "use_sliding_window", False
    ):
        return "it uses sliding-window attention, which packed attention does not implement"
    return None


def mechanism_problem(mechanism: str, device: torch.device, cp: int) -> str | None:
    """Why `mechanism` cannot run on `device` with context parallelism `cp`, or None when it can."""
    if mechanism == "packed":
        return None
    if cp > 1:
        return f"context parallelism splits samples across ranks, which only 'packed' attends (not '{mechanism}')"
    if mechanism == "dense":
        return None
    if device.type != "cuda":
        return f"'{mechanism}' runs on CUDA only (this trainer runs on {device.type}): use 'packed'"
    if mechanism == "varlen":
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen: use 'flex' or 'packed'"
    return None


def configure_attention(model: torch.nn.Module, requested: str, device: torch.device, cp: int) -> str:
    """Set `model`'s attention to `requested` ('auto': packed where the model allows it, else
    transformers' dense sdpa) and return the mechanism; ValueError says why it cannot run."""
    problem = model_problem(model)
    if requested == "auto":
        requested = "packed" if problem is None or cp > 1 else "dense"
    if requested != "dense" and problem is not None:
        why = "context parallelism attends through 'packed', which" if cp > 1 else f"'{requested}'"
        fix = "use cp = 1 for this model" if cp > 1 else "use 'dense' for this model"
        raise ValueError(f"{why} cannot replace this model's attention: {problem}; {fix}")
    problem = mechanism_problem(requested, device, cp)
    if problem is not None:
        raise ValueError(problem)
    use_packed_attention(model, requested)
    return requested


def use_packed_attention(model: torch.nn.Module, mechanism: str) -> None:
    """Route `model`'s attention through `mechanism` (registered with transformers under
    `prime_rl_<mechanism>`); 'dense' keeps transformers' sdpa with its [T, T] mask."""
    if mechanism == "dense":
        model.set_attn_implementation("sdpa")
        return
    from transformers import AttentionInterface

    name = f"prime_rl_{mechanism}"
    AttentionInterface.register(name, FUNCTIONS[mechanism])
    model.set_attn_implementation(name)
