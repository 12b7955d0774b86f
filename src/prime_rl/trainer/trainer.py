"""One optimizer step on the micro-batches of this rank, with the loss normalized globally.

Normalization (the contract of DESIGN.md):
1. before the micro-batch loop, all-reduce (sum) the local loss-token count over the dp group;
2. each micro-batch's loss is its token-loss sum divided by that global count;
3. after the loop, multiply the gradients by the factor FSDP divided them by (the dp size).
The gradient is then that of the per-token mean over the whole global batch, however the tokens
are split across ranks and micro-batches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.dist import World, all_reduce_max, all_reduce_sum
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.loss import LossInputs, LossOutputs, rl_loss, sample_ids
from prime_rl.trainer.model import load_model
from prime_rl.trainer.optim import build_optimizer, build_scheduler
from prime_rl.transport.messages import MicroBatch

LossFn = Callable[[LossInputs], LossOutputs]


@dataclass
class TokenStats:
    """Per-env count, sum, sum of squares and max of per-token metrics on this rank.

    Kept on the device and filled with index_add / scatter_reduce, so a step costs no host sync
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

    def add(self, metric: str, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Per-token `values` of the envs at `rows` (one row index per token)."""
        n = len(self.envs)
        m, mx = self.moments.get(metric), self.maxes.get(metric)
        if m is None or m.shape[0] < n:
            grown = torch.zeros(n, 3, dtype=torch.float64, device=self.device)
            grown_max = torch.full((n,), -math.inf, dtype=torch.float64, device=self.device)
            if m is not None:
                grown[: m.shape[0]] = m
                grown_max[: mx.shape[0]] = mx
            m, mx = self.moments[metric], self.maxes[metric] = grown, grown_max
        v = values.detach().to(torch.float64)
        m.index_add_(0, rows, torch.stack([torch.ones_like(v), v, v * v], dim=1))
        mx.scatter_reduce_(0, rows, v, reduce="amax")

    def reduce(self, world: World) -> dict[str, float]:
        metrics, envs = sorted(self.moments), sorted(self.envs)
        if world.distributed:
            gathered: list = [None] * world.world_size
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
        moments_host, maxes_host = everything.tolist(), top.tolist()  # the step's one host copy
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
        return out


@dataclass
class MicroBatchResult:
    """What the loss saw, per token, for metrics and the token export."""

    mb: MicroBatch
    trainer_logprobs: torch.Tensor
    token_loss: torch.Tensor
    masks: dict[str, torch.Tensor]


class Trainer:
    def __init__(self, config: TrainerConfig, world: World, loss_fn: LossFn | None = None):
        self.config = config
        self.world = world
        self.model = load_model(config.model, world)
        self.ref_model = None
        if config.loss.kl_coef > 0:
            self.ref_model = load_model(config.model, world)
            self.ref_model.requires_grad_(False)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.scheduler, config.max_steps)
        self.loss_fn: LossFn = loss_fn or (lambda inputs: rl_loss(inputs, config.loss))

    def _tensors(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        dev = self.world.device
        a = mb.arrays()
        return {
            "input_ids": torch.from_numpy(a["input_ids"].astype("int64")).to(dev),
            "position_ids": torch.from_numpy(a["position_ids"].astype("int64")).to(dev),
            "loss_mask": torch.from_numpy(a["loss_mask"].astype(bool)).to(dev),
            "advantages": torch.from_numpy(a["advantages"].copy()).to(dev),
            "logprobs": torch.from_numpy(a["logprobs"].copy()).to(dev),
        }

    def accumulate(self, micro_batches: list[MicroBatch]) -> tuple[TokenStats, list[MicroBatchResult], float]:
        """Forward and backward over this rank's micro-batches; returns stats and the global token count."""
        for mb in micro_batches:
            mb.validate(seq_len=self.config.seq_len)
        local = sum(int(mb.arrays()["loss_mask"].sum()) for mb in micro_batches)
        global_tokens = all_reduce_sum(torch.tensor(float(local), dtype=torch.float64), self.world).item()
        denom = max(global_tokens, 1.0)
        stats, results = TokenStats(self.world.device), []
        for mb in micro_batches:
            t = self._tensors(mb)
            lp, entropy = forward_logprobs(self.model, t["input_ids"], t["position_ids"], mb.temperature)
            ref = None
            if self.ref_model is not None:
                with torch.no_grad():
                    ref, _ = forward_logprobs(
                        self.ref_model, t["input_ids"], t["position_ids"], mb.temperature
                    )
            inputs = LossInputs(
                lp, t["logprobs"], t["advantages"], t["loss_mask"], entropy, mb.sample_lens, ref
            )
            out = self.loss_fn(inputs)
            (out.token_loss.sum() / denom).backward()
            self._record(stats, mb, t, lp.detach(), entropy, out)
            results.append(MicroBatchResult(mb, lp.detach(), out.token_loss.detach(), out.masks))
        if self.world.distributed:
            # FSDP2 averaged the reduce-scattered gradients over the dp ranks; the loss is already
            # divided by the global count, so undo that average.
            for p in self.model.parameters():
                if p.grad is not None:
                    p.grad.mul_(self.world.world_size)
        return stats, results, global_tokens

    def _record(
        self, stats: TokenStats, mb: MicroBatch, t: dict, lp: torch.Tensor, entropy, out: LossOutputs
    ) -> None:
        mask = t["loss_mask"]
        rows = stats.rows(mb.env_names)[sample_ids(mb.sample_lens, mask.device)][
            mask
        ]  # env row per loss token
        d = (lp - t["logprobs"])[mask]
        stats.add("loss", rows, out.token_loss[mask])
        stats.add("entropy", rows, entropy[mask])
        stats.add("mismatch_kl", rows, torch.exp(d) - 1 - d)  # KL(sampler || trainer), k3 estimate
        for name, flag in out.masks.items():
            stats.add(name, rows, flag[mask].float())

    def optimizer_step(self) -> float:
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optim.max_norm)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def train_step(self, micro_batches: list[MicroBatch]) -> tuple[dict[str, float], list[MicroBatchResult]]:
        t0 = time.perf_counter()
        if self.world.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        lr = self.scheduler.get_last_lr()[0]
        stats, results, global_tokens = self.accumulate(micro_batches)
        metrics = stats.reduce(self.world)
        loss_sum = sum(float(r.token_loss.sum()) for r in results)
        loss = all_reduce_sum(torch.tensor(loss_sum, dtype=torch.float64), self.world).item() / max(
            global_tokens, 1
        )
        if not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            grad_norm = float("nan")
        else:
            grad_norm = self.optimizer_step()
        elapsed = time.perf_counter() - t0
        tokens = all_reduce_sum(
            torch.tensor(float(sum(mb.num_tokens for mb in micro_batches))), self.world
        ).item()
        metrics.update(
            {
                "loss": loss,
                "grad_norm": grad_norm,
                "lr": lr,
                "loss_tokens": global_tokens,
                "tokens": tokens,
                "throughput/tokens_per_s": tokens / max(elapsed, 1e-9),
                "time/train": elapsed,
                "peak_memory_gb": peak_memory_gb(self.world),
            }
        )
        return metrics, results


def peak_memory_gb(world: World) -> float:
    if world.device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB
