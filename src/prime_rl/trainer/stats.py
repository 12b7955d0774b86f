"""Per-token metrics of a step, per env and over all envs, kept on the device until the step ends.

Invariant: recording a metric costs no host sync; `TokenStats.reduce` sums over all ranks and copies
to the host once per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from prime_rl.runtime import activity
from prime_rl.trainer.parallel.dist import World, all_reduce_max, all_reduce_sum

ESS_METRICS = ("is_ratio", "is_weight")
"""Importance weights whose normalized effective sample size (sum w)^2 / (n sum w^2) is logged too:
1 when every token weighs the same, 1/n when one token carries all the weight."""


@dataclass
class TokenStats:
    """Per-env count, sum, sum of squares and max of per-token metrics on this rank.

    Kept on the device and filled with index_add / scatter_reduce over masked dense tensors (a
    boolean index would size its result on the host: a GPU sync), so a step costs no host sync
    until `reduce`, which copies everything to the host once (after the all-reduce over ranks).
    """

    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    envs: dict[str, int] = field(default_factory=dict)
    """Env name -> row in the tensors below."""
    moments: dict[str, torch.Tensor] = field(default_factory=dict)
    """Metric -> [envs, 3] float64: token count, sum, sum of squares."""
    maxes: dict[str, torch.Tensor] = field(default_factory=dict)
    """Metric -> [envs] float64."""

    def rows(self, env_names: list[str]) -> torch.Tensor:
        """The row of each env name (new names get new rows)."""
        return torch.tensor([self.envs.setdefault(e, len(self.envs)) for e in env_names], device=self.device)

    def add(self, metric: str, rows: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Per-token `values` of the envs at `rows` (one row index per token), of the tokens in `mask`."""
        n = len(self.envs)
        m, mx = self.moments.get(metric), self.maxes.get(metric)
        if m is None or m.shape[0] < n:
            grown = torch.zeros(n, 3, dtype=torch.float64, device=self.device)
            grown_max = torch.full((n,), -math.inf, dtype=torch.float64, device=self.device)
            if m is not None:
                grown[: m.shape[0]] = m
                grown_max[: mx.shape[0]] = mx
            m, mx = self.moments[metric], self.maxes[metric] = grown, grown_max
        w = mask.to(torch.float64)
        v = torch.where(mask, values.detach().to(torch.float64), 0.0)
        m.index_add_(0, rows, torch.stack([w, v, v * v], dim=1))
        mx.scatter_reduce_(0, rows, torch.where(mask, v, -math.inf), reduce="amax")

    def reduce(self, world: World) -> dict[str, float]:
        metrics, envs = sorted(self.moments), sorted(self.envs)
        if world.distributed:
            gathered: list = [None] * world.world_size
            with activity.waiting("an all_gather of the metric names", "trainer"):
                dist.all_gather_object(gathered, (metrics, envs))
            metrics = sorted({k for ms, _ in gathered for k in ms})
            envs = sorted({e for _, es in gathered for e in es})
        moments = torch.zeros(len(metrics), len(envs), 3, dtype=torch.float64, device=self.device)
        maxes = torch.full((len(metrics), len(envs)), -math.inf, dtype=torch.float64, device=self.device)
        cols = torch.tensor([envs.index(e) for e in self.envs], device=self.device, dtype=torch.long)
        for i, name in enumerate(metrics):
            if name in self.moments:
                k = self.moments[name].shape[0]
                moments[i, cols[:k]] = self.moments[name]
                maxes[i, cols[:k]] = self.maxes[name]
        moments, maxes = all_reduce_sum(moments, world), all_reduce_max(maxes, world)
        everything = torch.cat([moments.sum(dim=1, keepdim=True), moments], dim=1)  # "all" first
        top = torch.cat([maxes.max(dim=1, keepdim=True).values if envs else maxes[:, :0], maxes], dim=1)
        moments_host, maxes_host = world.host(everything), world.host(top)  # the step's host copies
        out = {}
        for i, name in enumerate(metrics):
            for j, env in enumerate(["all", *envs]):
                n, s, ss = moments_host[i][j]
                if n == 0:
                    continue
                mean = s / n
                out[f"{name}/{env}/mean"] = mean
                out[f"{name}/{env}/std"] = math.sqrt(max(ss / n - mean * mean, 0.0))
                out[f"{name}/{env}/max"] = maxes_host[i][j]
                if name in ESS_METRICS and ss > 0:
                    out[f"{name}/{env}/ess"] = s * s / (n * ss)
        return out
