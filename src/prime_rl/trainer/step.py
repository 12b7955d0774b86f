"""One optimizer step over this rank's micro-batches, shared by RL, SFT and reward-model training.

What a kind of training adds is an `Objective`: a first pass without gradients (`prepare`), each
micro-batch's loss (`loss`), and the step's metrics from what the losses recorded (`metrics`). The
step does the rest, the same for every kind:

1. before the micro-batch loop, all-reduce (sum) the loss tokens and samples this rank owns over all
   dp x cp ranks (`Totals`): a micro-batch's loss is its owned tokens' losses divided by such a
   global count, so the gradient is that of the mean over the whole global batch, however the
   tokens are split across ranks, micro-batches and context-parallel shards;
2. forward and backward of each micro-batch, with the mixture-of-experts bookkeeping around it;
3. multiply the gradients by the factor FSDP divided them by (the ranks it shards over);
4. clip and update each trained part, or leave every parameter as it is when the step has no loss
   token, a non-finite loss or a non-finite gradient norm (counted in `nonfinite_updates`).

Invariant: the parts' gradients are zero (None) when the step starts and when it ends; the step's
counts that every rank of a cp group holds (samples, total tokens) are counted on its cp rank 0 only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from prime_rl.trainer.batch import PackedBatch
from prime_rl.trainer.memory import peak_memory_gb
from prime_rl.trainer.model import fsdp_group_size
from prime_rl.trainer.moe.step import MoEStep
from prime_rl.trainer.optim import clip_grad_norm
from prime_rl.trainer.parallel.dist import World, all_reduce_sum
from prime_rl.trainer.stats import TokenStats


@dataclass
class Part:
    """A module the step trains, with its optimizer."""

    prefix: str
    """Of its metrics: '' for the policy, 'critic/' for a critic."""
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    max_norm: float


@dataclass(frozen=True)
class Totals:
    """The step's counts over all ranks."""

    loss_tokens: float
    """Loss tokens: the per-token mean's denominator."""
    samples: float
    """Samples with at least one loss token."""
    tokens: float
    """Every token of every micro-batch (padding and filler included)."""


@dataclass
class Context:
    """What a micro-batch's loss gets besides its own item."""

    totals: Totals
    world: World
    trains: Sequence[bool]
    """Which parts are differentiated and updated this step (parts[0]: the policy)."""
    stats: TokenStats
    """Per-token metrics, reduced once when the step ends."""
    moe: MoEStep | None
    """The mixture-of-experts bookkeeping (None: a dense model)."""

    def routing(self, b: PackedBatch) -> AbstractContextManager:
        """Around a micro-batch's forward of the policy: count its experts' loads and replay the
        sampler's routes when it carries them (a dense model: nothing)."""
        if self.moe is None:
            return nullcontext()
        routes = b.shard.take(b.routes) if b.routes is not None else None
        return self.moe.forward(b.shard.take(b.real), routes)

    def aux_loss(self, routing, b: PackedBatch) -> torch.Tensor | None:
        """The micro-batch's load-balancing term, weighted by its share of the loss tokens (None:
        none to add)."""
        if self.moe is None:
            return None
        return self.moe.aux_loss(routing, b.counted.sum() / max(self.totals.loss_tokens, 1.0))


class Objective(Protocol):
    """What one kind of training adds to the step."""

    def prepare(self, batches: list[PackedBatch]) -> tuple[list[Any], dict[str, float]]:
        """First pass, without gradients: one item per micro-batch, and step metrics."""
        ...

    def loss(self, item: Any, ctx: Context) -> tuple[torch.Tensor, Any]:
        """One micro-batch's forward: the loss to backpropagate (already divided by a global count of
        `ctx.totals`) and what to keep of it (its record)."""
        ...

    def metrics(self, records: list[Any], ctx: Context) -> dict[str, float]:
        """The step's metrics from its records, the same on every rank; 'loss' among them."""
        ...


def totals(batches: Sequence[PackedBatch], world: World) -> Totals:
    lead = world.cp_rank == 0  # a cp group's samples and tokens are counted once
    local = world.scalars(
        0.0,
        sum(b.samples_with_loss for b in batches) if lead else 0.0,
        sum(b.num_tokens for b in batches) if lead else 0.0,
    )
    for b in batches:
        local[0] = local[0] + b.counted.sum()
    return Totals(*world.host(all_reduce_sum(local, world)))


def undo_fsdp_average(parts: Sequence[Part], world: World) -> None:
    """FSDP2 averaged the reduce-scattered gradients over each parameter's group (all dp x cp ranks;
    the experts' copies under ep); the loss is already divided by the global count, so undo it."""
    if not world.distributed:
        return
    for part in parts:
        for param in part.module.parameters():
            if param.grad is not None:
                param.grad.mul_(fsdp_group_size(param))


def update(parts: Sequence[Part], trains: Sequence[bool], world: World) -> dict[str, float]:
    """Clip and step each part that trains this step (a part whose norm is not finite skips its
    update); every part's gradients are dropped."""
    out = {}
    for part, enabled in zip(parts, trains, strict=True):
        grad_norm = float("nan")
        if enabled:
            grad_norm = world.host(clip_grad_norm(part.module.parameters(), part.max_norm))
            if math.isfinite(grad_norm):
                part.optimizer.step()
        part.optimizer.zero_grad(set_to_none=True)
        out[f"{part.prefix}grad_norm"] = grad_norm
    return out


@dataclass
class Accumulated:
    """A step's gradients are in the modules; this is what else the pass produced."""

    metrics: dict[str, float]
    """The objective's and the per-token metrics, reduced over the ranks."""
    records: list[Any]
    totals: Totals


@dataclass
class StepState:
    """What a step's mini-batches share: the first pass's items and metrics, the per-token
    statistics and the MoE bookkeeping."""

    objective: Objective
    batches: list[PackedBatch]
    parts: Sequence[Part]
    world: World
    trains: list[bool]
    items: list[Any]
    first: dict[str, float]
    stats: TokenStats
    moe: MoEStep | None

    @classmethod
    def start(
        cls,
        objective: Objective,
        batches: list[PackedBatch],
        parts: Sequence[Part],
        world: World,
        trains: Sequence[bool] | None,
        moe: tuple[bool, float],
    ) -> StepState:
        items, first = objective.prepare(batches)
        trains = list(trains) if trains is not None else [True] * len(parts)
        moe_step = MoEStep.start(parts[0].module, moe[0], moe[1], world)
        return cls(objective, batches, parts, world, trains, items, first, TokenStats(world.device), moe_step)

    def context(self, n: Totals) -> Context:
        return Context(n, self.world, self.trains, self.stats, self.moe)

    def mini_batch(self, group: range) -> tuple[list[Any], Context, dict[str, float]]:
        """Forward and backward of the micro-batches in `group`, normalized by their own global
        counts: their records, context and the objective's metrics over them."""
        ctx = self.context(totals([self.batches[i] for i in group], self.world))
        records = backward(self.objective, [self.items[i] for i in group], self.parts, ctx)
        return records, ctx, self.objective.metrics(records, ctx)

    def metrics(self, own: dict[str, float]) -> dict[str, float]:
        """The step's metrics: the first pass's, the per-token ones (reduced over the ranks), the
        MoE loads and the objective's own (`own`)."""
        metrics = {**self.first, **self.stats.reduce(self.world)}
        if self.moe is not None:
            metrics.update(self.moe.metrics())
        metrics.update(own)
        return metrics


def accumulate(
    objective: Objective,
    batches: list[PackedBatch],
    parts: Sequence[Part],
    world: World,
    trains: Sequence[bool] | None = None,
    moe: tuple[bool, float] = (False, 0.0),
) -> Accumulated:
    """Forward and backward over this rank's `batches`, with the global normalization, and no
    update. `parts[0]` is the policy; `trains`: which parts learn this step (default: all); `moe`:
    (replay the sampler's routes, the load-balancing loss's coefficient)."""
    state = StepState.start(objective, batches, parts, world, trains, moe)
    records, ctx, own = state.mini_batch(range(len(batches)))
    return Accumulated(state.metrics(own), records, ctx.totals)


def backward(objective: Objective, items: Sequence[Any], parts: Sequence[Part], ctx: Context) -> list[Any]:
    """Forward and backward of each item's loss (gradients summed into the parts), then FSDP's
    average undone: the records."""
    records = []
    for item in items:
        loss, record = objective.loss(item, ctx)
        if loss.requires_grad:
            loss.backward()
        records.append(record)
    undo_fsdp_average(parts, ctx.world)
    return records


def splits(n: int, k: int) -> list[range]:
    """`n` micro-batches in `k` contiguous mini-batches as even as can be (none empty; fewer than `k`
    when n < k). Every rank holds as many micro-batches, so every rank splits alike."""
    k = max(1, min(k, n))
    return [range(i * n // k, (i + 1) * n // k) for i in range(k)]


def train_step(
    objective: Objective,
    batches: list[PackedBatch],
    parts: Sequence[Part],
    scheduler,
    world: World,
    *,
    trains: Sequence[bool] | None = None,
    moe: tuple[bool, float] = (False, 0.0),
    mini_batches: int = 1,
) -> tuple[dict[str, float], list[Any]]:
    """(metrics, records) of one step on this rank's `batches`: the first pass, then per mini-batch
    (`mini_batches` contiguous groups of micro-batches, each normalized by its own global counts)
    the forward and backward and an optimizer update. `scheduler` is the policy's and moves once per
    step; `trains`: which parts update this step (default: all)."""
    t0 = time.perf_counter()
    if world.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    lr = scheduler.get_last_lr()[0]
    state = StepState.start(objective, batches, parts, world, trains, moe)
    groups = splits(len(batches), mini_batches)  # never empty: at least one group
    records, outcomes = [], []
    for group in groups:
        done, ctx, own = state.mini_batch(group)
        records.extend(done)
        outcomes.append(settle(parts, state.trains, world, ctx.totals, own["loss"]))  # its own loss decides
    if len(groups) > 1:  # the step's counts and metrics over all groups (one group: they are its own)
        ctx = state.context(totals(batches, world))
        own = objective.metrics(records, ctx)
    metrics = state.metrics(own)
    if mini_batches > 1:
        metrics["optimizer_steps"] = float(sum(o.updated for o in outcomes))
    # (the loop counts a step with any such update toward `max_nan_steps`)
    metrics["nonfinite_updates"] = float(sum(o.nonfinite for o in outcomes))
    n = ctx.totals
    for key in {k for o in outcomes for k in o.metrics}:
        values = [o.metrics[key] for o in outcomes if key in o.metrics]
        metrics[key] = sum(values) / len(values)  # one mini-batch: its value; several: their mean
    if state.trains[0] and all(o.schedule for o in outcomes):
        scheduler.step()  # once per step: the schedule counts steps, not mini-batches
    elapsed = time.perf_counter() - t0
    metrics.update(
        {
            "lr": lr if state.trains[0] else 0.0,
            "loss_tokens": n.loss_tokens,
            "tokens": n.tokens,
            "throughput/tokens_per_s": n.tokens / max(elapsed, 1e-9),
            "time/train": elapsed,
            "peak_memory_gb": peak_memory_gb(world),
        }
    )
    return metrics, records


@dataclass(frozen=True)
class Settled:
    metrics: dict[str, float]
    """The update's (grad norms); a non-finite loss's grad_norm is NaN; none without loss tokens."""
    updated: bool
    """Whether the policy's parameters moved (its loss and gradient norm were finite)."""
    schedule: bool
    """Whether the learning-rate schedule moves on (not after a non-finite loss or gradient)."""
    nonfinite: bool
    """The loss, or a trained part's gradient norm, was not finite: the step counts toward
    `max_nan_steps`."""


def settle(parts: Sequence[Part], trains: Sequence[bool], world: World, n: Totals, loss: float) -> Settled:
    """Update the parts from their gradients, or, with no loss token to learn from (every sample
    filtered or failed) or a non-finite loss, drop the gradients and leave the parameters as they
    are (an AdamW step on zero gradients would still move them). A part whose gradient norm is not
    finite skips its update (`update`): for the policy that is a skipped step like a NaN loss."""
    if n.loss_tokens == 0:  # nothing to learn from is no reason to stop the schedule
        for part in parts:
            part.optimizer.zero_grad(set_to_none=True)
        return Settled({}, updated=False, schedule=True, nonfinite=False)
    if not math.isfinite(loss):
        for part in parts:
            part.optimizer.zero_grad(set_to_none=True)
        return Settled({"grad_norm": float("nan")}, updated=False, schedule=False, nonfinite=True)
    metrics = update(parts, trains, world)
    norms = [metrics[f"{p.prefix}grad_norm"] for p, t in zip(parts, trains, strict=True) if t]
    policy = math.isfinite(metrics["grad_norm"]) if trains[0] else True
    return Settled(
        metrics,
        updated=trains[0] and policy,
        schedule=policy,
        nonfinite=not all(math.isfinite(x) for x in norms),
    )
