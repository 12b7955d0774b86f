"""Weights in memory from trainer rank 0 to the inference workers: one torch.distributed broadcast
group per update, shared by both ends (the trainer and the vLLM worker extension import it).

Invariant: both ends walk the same plan (chunks of named tensors, in order), so the receiver knows
every tensor's place without a message per tensor. Each chunk travels as one flat byte buffer: one
collective per chunk, not per tensor, and the receiver allocates a fresh buffer per chunk, because
vLLM's in-place reload keeps references to loaded tensors until a layer is complete. The group is
made for one update (a store prefix per update) and dropped after it, so a server that died or
restarted never leaves a broken group behind. The group forms through the run's own store
(`auth/store.py`), which only the run's processes can reach. Gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from prime_rl.runtime import secret

DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.uint8,
    )
}


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


Plan = list[list[Entry]]
"""Chunks of tensors, in the order both ends walk them."""


def make_plan(state: dict[str, torch.Tensor], chunk_bytes: int, cast: str | None = None) -> Plan:
    """`state`'s tensors cut into chunks of at most `chunk_bytes` (a bigger tensor is a chunk alone);
    with `cast` (a dtype name), floating-point tensors travel in that dtype (the servers' own)."""
    plan: Plan = [[]]
    size = 0
    for name, t in state.items():
        dtype = cast if cast and t.is_floating_point() else str(t.dtype).removeprefix("torch.")
        entry = Entry(name, dtype, tuple(t.shape))
        if plan[-1] and size + entry.nbytes > chunk_bytes:
            plan.append([])
            size = 0
        plan[-1].append(entry)
        size += entry.nbytes
    return [c for c in plan if c]


def plan_to_json(plan: Plan) -> list[list[list]]:
    return [[[e.name, e.dtype, list(e.shape)] for e in chunk] for chunk in plan]


def plan_from_json(data: list[list[list]]) -> Plan:
    return [[Entry(str(n), str(d), tuple(int(s) for s in shape)) for n, d, shape in chunk] for chunk in data]


def pack_chunk(state: dict[str, torch.Tensor], chunk: list[Entry], device: torch.device) -> torch.Tensor:
    """One chunk's tensors as one contiguous byte buffer (the sender's side)."""
    parts = [
        state[e.name].detach().to(DTYPES[e.dtype]).contiguous().reshape(-1).view(torch.uint8) for e in chunk
    ]
    return torch.cat(parts).to(device)


def unpack_chunk(buffer: torch.Tensor, chunk: list[Entry]) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of `buffer` as the chunk's named tensors (the receiver's side)."""
    offset = 0
    for e in chunk:
        n = e.nbytes
        yield e.name, buffer[offset : offset + n].view(DTYPES[e.dtype]).view(e.shape)
        offset += n


def chunk_bytes(chunk: list[Entry]) -> int:
    return sum(e.nbytes for e in chunk)


def join_group(store: dist.Store, prefix: str, rank: int, world_size: int, timeout_s: float, cuda: bool):
    """A process group of `world_size` ranks under `prefix`; blocks until all of them joined. It
    leaves torch's default group alone (vLLM's workers already have one of their own)."""
    scoped = dist.PrefixStore(prefix, store)
    if cuda:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(scoped, rank, world_size, options)
    return dist.ProcessGroupGloo(scoped, rank, world_size, timedelta(seconds=timeout_s))


def broadcast(group, buffer: torch.Tensor):
    """Start sending rank 0's `buffer` into every other rank's `buffer`; wait on what it returns.
    Both ends keep one chunk in flight while they pack or load the previous one."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([buffer], options)


TAG = 32


def seal_key(prefix: str) -> bytes | None:
    """The key that seals one update's chunks on CPU (gloo), None without a run secret. gloo's pairs
    connect over plain TCP once the store introduced them: a tag per chunk means that whoever took a
    pair can break the update, never fill it. (NCCL, on GPUs, checks its own random magic.)"""
    return secret.key(f"weights-chunks/{prefix}")


def _tag(key: bytes, index: int, data: torch.Tensor) -> torch.Tensor:
    mac = hmac.new(key, index.to_bytes(8, "big"), hashlib.sha256)
    mac.update(data.numpy().data)
    return torch.frombuffer(bytearray(mac.digest()), dtype=torch.uint8)


def send(
    group, state: dict[str, torch.Tensor], plan: Plan, device: torch.device, key: bytes | None = None
) -> None:
    """Rank 0: broadcast `state` chunk by chunk, packing the next chunk while one is on the wire;
    with `key` (CPU only), each chunk ends with its tag."""
    in_flight = None
    for i, chunk in enumerate(plan):
        buffer = pack_chunk(state, chunk, device)
        if key is not None:
            buffer = torch.cat([buffer, _tag(key, i, buffer)])
        work = broadcast(group, buffer)
        if in_flight is not None:
            in_flight[1].wait()
        in_flight = (buffer, work)  # the buffer must outlive its broadcast
    if in_flight is not None:
        in_flight[1].wait()


class Unsealed(RuntimeError):
    """A chunk whose tag is not the run's: someone else's bytes on a pair of the group."""


def receive(
    group, plan: Plan, device: torch.device, key: bytes | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The other ranks: the named tensors, in plan order; the next chunk arrives while the caller
    loads this one. With `key`, a chunk is checked before any of its tensors is handed out."""
    extra = TAG if key is not None else 0

    def start(chunk: list[Entry]):
        buffer = torch.empty(chunk_bytes(chunk) + extra, dtype=torch.uint8, device=device)  # fresh: see above
        return buffer, broadcast(group, buffer)

    following = start(plan[0]) if plan else None
    refused = None
    for i, chunk in enumerate(plan):
        buffer, work = following
        work.wait()
        following = start(plan[i + 1]) if i + 1 < len(plan) else None
        if key is not None:
            buffer, tag = buffer[:-TAG], buffer[-TAG:]
            if not hmac.compare_digest(tag.numpy().tobytes(), _tag(key, i, buffer).numpy().tobytes()):
                refused = refused or f"chunk {i} of the update is not the trainer's (its tag does not match)"
        if refused is None:
            yield from unpack_chunk(buffer, chunk)
    if refused is not None:  # (raised after every chunk was taken: rank 0 is not left waiting)
        raise Unsealed(refused)
