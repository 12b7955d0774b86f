"""The process's place among the trainer ranks (torchrun sets RANK / WORLD_SIZE / LOCAL_RANK).

Data parallelism only for now: the "dp x cp" group of the loss normalization is the dp group.
On CPU the backend is gloo; on CUDA, nccl.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_world() -> World:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return World(rank, world_size, local_rank, device)


def all_reduce_sum(value: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def all_reduce_max(value: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value
