"""Context parallelism: the tokens of one packed micro-batch split across the `cp` ranks of a group.

Split: the micro-batch's T positions are cut into 2 * cp contiguous chunks; rank r holds chunks r and
2 * cp - 1 - r (an early and a late one), so under causal attention every rank has about the same
work. Ranks are padded to one length L (at most one or two positions); padding attends only to
padding and its outputs are dropped.

Attention: a query sees the keys of its own sample at or before it. Most of those a rank holds
already; the others, the keys of a sample that began in an earlier chunk, come from their ranks in
one all-to-all per layer (after RoPE, which used the real position ids), and in backward their
gradients go back the same way. Which keys go where follows from the sample lengths alone, so every
rank computes the exchange without talking. The attention itself is `trainer/attention.py`'s packed
attention over this rank's segments: no mask of the micro-batch is built, and a rank's attention
memory grows with its own tokens plus the keys of the samples it shares with earlier chunks.
The all-to-all is a collective that nccl and gloo both have, so CPU tests run the GPU's code.

Invariant: every per-position value a rank computes (logprobs, entropies, values) is gathered back
to the full micro-batch with `SequenceShard.gather`, whose backward sums the group's gradients, so
the losses see the same full-length tensors as without cp and need no change. Each rank then adds
to its loss only the tokens it *owns* (those predicted from its positions), so the group's losses
sum to the micro-batch's loss once. With cp = 1 the shard is the whole micro-batch and every
method is the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.nn.functional import all_to_all_single

from prime_rl.trainer.attention import PLAN_KWARG, AttentionPlan, Segment, build_plan, plan_for_samples


def _all_gather_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    # torch 2.13 renamed the single-buffer collectives; older releases have only the old names.
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)


def _reduce_scatter_single(out: torch.Tensor, x: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, op=dist.ReduceOp.SUM, group=group)


@dataclass(frozen=True)
class SequenceShard:
    """This rank's share of one packed micro-batch of `length` positions."""

    length: int
    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    index: torch.Tensor | None = None
    """[L] the micro-batch position of each local position; padding holds `length` (out of range)."""
    attention: AttentionPlan | None = None
    """How the local queries attend (built once per micro-batch, used by every layer)."""
    key_positions: np.ndarray | None = None
    """[rows] the micro-batch position of each key row the plan indexes: the local positions (padding
    holds `length`), then those received from the other ranks."""

    @property
    def split(self) -> bool:
        return self.size > 1

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The local positions of a per-position tensor of shape [T, ...] (padding gets 0)."""
        if not self.split:
            return full
        padded = torch.cat([full, full.new_zeros(1, *full.shape[1:])])
        return padded[self.index]

    def take_on_host(self, full: np.ndarray) -> np.ndarray:
        """`take` for a host array [T]: the same local positions, computed without the device."""
        if not self.split:
            return full
        return np.append(full, np.zeros(1, full.dtype))[
            _all_indices_on_host(self.length, self.size)[self.rank]
        ]

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
        """Keyword arguments of a model call that hand its attention layers this shard's plan."""
        return {PLAN_KWARG: self.attention} if self.attention is not None else {}


def shard_micro_batch(
    sample_lens: list[int], size: int, rank: int, group, device: torch.device
) -> SequenceShard:
    """This rank's shard of a micro-batch made of samples of `sample_lens` tokens."""
    length = sum(sample_lens)
    if size == 1:
        return SequenceShard(length, attention=plan_for_samples(sample_lens, device))
    indices = _all_indices(length, size, device)  # [size, L]
    layout = _Layout(sample_lens, size)
    keys, segments, send_rows, sends, recvs = layout.for_rank(rank)
    send_index = torch.as_tensor(send_rows, device=device)

    def exchange(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Local key and value rows [L, Hkv, D] -> the other ranks' rows this rank needs [R, Hkv, D]."""
        sent = torch.stack([k[send_index], v[send_index]], 1)
        empty = sent.new_empty((sum(recvs), *sent.shape[1:]))
        got = all_to_all_single(empty, sent, recvs, sends, group=group)
        return got[:, 0], got[:, 1]

    # Every rank sees the whole exchange: when no sample crosses a chunk border, no rank calls it.
    shared = any(len(n) for n in layout.needed)
    plan = build_plan(segments, layout.width, device, exchange=exchange if shared else None)
    return SequenceShard(length, size, rank, group, indices[rank], plan, keys)


class _Layout:
    """Which positions each rank holds and which keys it needs from the others, from the sample
    lengths alone (numpy on the host: every rank computes the whole exchange the same way)."""

    def __init__(self, sample_lens: list[int], size: int):
        self.size, self.length = size, int(sum(sample_lens))
        n = 2 * size
        # Chunk sizes as torch's tensor_split (`_all_indices`) makes them: the first ones one longer.
        lens = np.array([len(c) for c in np.array_split(np.arange(self.length), n)])
        self.chunk_start = np.concatenate([[0], np.cumsum(lens)])
        self.starts = np.concatenate([[0], np.cumsum(sample_lens)])
        self.held = [lens[r] + lens[n - 1 - r] for r in range(size)]
        self.width = int(max(self.held))
        position = np.arange(self.length)
        chunk = np.searchsorted(self.chunk_start, position, side="right") - 1
        self.owner = np.where(chunk < size, chunk, n - 1 - chunk)
        first = np.where(chunk < size, 0, lens[n - 1 - chunk])  # a late chunk follows its rank's early one
        self.local_row = first + position - self.chunk_start[chunk]
        self.needed = [self._needed(r) for r in range(size)]

    def chunks(self, rank: int) -> list[tuple[int, int, int]]:
        """(start, end, first local row) of the rank's two chunks."""
        a, b = rank, 2 * self.size - 1 - rank
        first_b = self.chunk_start[a + 1] - self.chunk_start[a]
        return [
            (self.chunk_start[a], self.chunk_start[a + 1], 0),
            (self.chunk_start[b], self.chunk_start[b + 1], first_b),
        ]

    def sample_of(self, position: int) -> int:
        return int(np.searchsorted(self.starts, position, side="right")) - 1

    def _needed(self, rank: int) -> np.ndarray:
        """The positions before its chunks, in samples those chunks continue, that other ranks hold."""
        parts = [np.arange(self.starts[self.sample_of(s)], s) for s, e, _ in self.chunks(rank) if e > s]
        needed = np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)
        return needed[self.owner[needed] != rank]

    def for_rank(self, rank: int):
        """(key positions, segments, rows to send, send sizes, receive sizes) of one rank."""
        size, width = self.size, self.width
        received = np.concatenate(
            [self.needed[rank][self.owner[self.needed[rank]] == j] for j in range(size)]
        )
        recvs = [int((self.owner[self.needed[rank]] == j).sum()) for j in range(size)]
        to = [self.needed[j][self.owner[self.needed[j]] == rank] for j in range(size)]
        send_rows = np.concatenate([self.local_row[p] for p in to]).astype(np.int64)
        sends = [len(p) for p in to]
        key_positions = np.full(width + len(received), self.length, dtype=np.int64)
        for start, end, first in self.chunks(rank):
            key_positions[first : first + end - start] = np.arange(start, end)
        key_positions[width:] = received
        row_of = np.full(self.length, -1, dtype=np.int64)
        real = key_positions < self.length
        row_of[key_positions[real]] = np.nonzero(real)[0]
        segments = []
        for start, end, first in self.chunks(rank):
            if end == start:
                continue
            for s in range(self.sample_of(start), self.sample_of(end - 1) + 1):
                a, b = max(self.starts[s], start), min(self.starts[s + 1], end)
                segments.append(Segment(int(first + a - start), int(b - a), row_of[self.starts[s] : b]))
        held = self.held[rank]
        if held < width:  # padding attends to padding only
            segments.append(Segment(int(held), int(width - held), np.arange(held, width)))
        return key_positions, segments, send_rows, sends, recvs


def _all_indices(length: int, size: int, device: torch.device) -> torch.Tensor:
    """[size, L]: rank r's positions (chunks r and 2 * size - 1 - r of 2 * size), padded with `length`."""
    return torch.from_numpy(_all_indices_on_host(length, size)).to(device)


def _all_indices_on_host(length: int, size: int) -> np.ndarray:
    """`_all_indices` in numpy: the host reads them without the device (under the fake-GPU dry run
    every tensor is a device's)."""
    chunks = np.array_split(np.arange(length), 2 * size)  # the first ones one longer
    per_rank = [np.concatenate([chunks[r], chunks[2 * size - 1 - r]]) for r in range(size)]
    width = max(len(p) for p in per_rank)
    return np.stack([np.pad(p, (0, width - len(p)), constant_values=length) for p in per_rank])


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
