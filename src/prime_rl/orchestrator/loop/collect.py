"""Collecting one step's groups: follow the trainer's weights, drop what is stale, dispatch what the
async level allows, and wait until the step's batch is full.

Invariant: the async level moves only when new weights arrive, by the ESS the trainer published
with them (`staleness.py`); and a step's collect time splits into generating, waiting for the
trainer (nothing in flight and the next weights needed) and reloading weights, so that the step
line says where the time went.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.loop.eval import Evaluator
from prime_rl.orchestrator.loop.health import ServerHealth
from prime_rl.orchestrator.loop.pipeline import FinishedGroup
from prime_rl.orchestrator.loop.scheduler import Scheduler
from prime_rl.orchestrator.loop.servers import ServerPool
from prime_rl.orchestrator.loop.staleness import AsyncLevel, adapt
from prime_rl.orchestrator.loop.weights import WeightSync
from prime_rl.orchestrator.rollout import Rollout
from prime_rl.runtime import activity
from prime_rl.runtime.layout import read_trainer_stats, weights_root
from prime_rl.sandbox.tools_host import slow_call

log = logging.getLogger("prime_rl.orchestrator")


@dataclass
class Collected:
    """What a step collected: its finished groups, what was dropped meanwhile, and timings."""

    groups: list[FinishedGroup]
    failures: list[Rollout]
    uniform: list[FinishedGroup]
    """Groups dynamic sampling dropped (all rewards equal)."""
    short: bool
    """Dynamic sampling stopped waiting: fewer than batch_size rollouts."""
    times: dict[str, float]


class Collector:
    """Each step's groups, and the async level that bounds how far ahead they are dispatched."""

    def __init__(
        self,
        config: OrchestratorConfig,
        scheduler: Scheduler,
        pool: ServerPool,
        weights: WeightSync,
        health: ServerHealth,
        evaluator: Evaluator | None,
    ):
        self.config = config
        self.scheduler = scheduler
        self.pool = pool
        self.weights = weights
        self.health = health
        self.evaluator = evaluator
        self.async_level = AsyncLevel(config.max_async_level)

    async def collect(self, step: int) -> Collected:
        """Follow the weights, drop what is stale, dispatch, and wait until the step's groups are in."""
        c, sched = self.config, self.scheduler
        t_start = time.perf_counter()
        next_notice = t_start + 10.0
        t_blocked = 0.0  # time nothing could be generated because the trainer is too far behind
        t_reload = 0.0
        while True:
            t_poll, before = time.perf_counter(), self.weights.version
            version = await self.weights.poll()
            if version != before:
                t_reload += time.perf_counter() - t_poll
                await self._adapt_async_level(version)
            level = self.async_level.level
            sched.drop_stale(step)
            sched.fill(step, version, level)
            taken = sched.take_batch()
            if taken is not None:
                break
            blocked = not sched.inflight and step - version > level
            activity.doing(*waiting_for(step, step - level, blocked), step)
            if time.perf_counter() > next_notice:
                self._notice_waiting(step, blocked)
                next_notice = time.perf_counter() + 30.0
            t_wait = time.perf_counter()
            await sched.wait(timeout=c.weights_poll_s)
            self.health.raise_if_failed()
            if self.evaluator:
                self.evaluator.raise_if_failed()
            if blocked:
                t_blocked += time.perf_counter() - t_wait
        t_collect = time.perf_counter() - t_start
        times = {
            "time/generate": max(0.0, t_collect - t_blocked - t_reload),
            "time/wait_trainer": t_blocked,
            "time/reload": t_reload,
            "time/collect": t_collect,
        }
        return Collected(taken.groups, taken.failures, taken.uniform, taken.short, times)

    async def _adapt_async_level(self, version: int) -> None:
        """With `adaptive_async`, move the async level by the ESS the trainer published with the
        weights of `version` (`loop/staleness.py`)."""
        c = self.config
        if not c.adaptive_async.enabled:
            return
        stats = await asyncio.to_thread(read_trainer_stats, weights_root(Path(c.output_dir)), version)
        before = self.async_level
        self.async_level = adapt(
            before, (stats or {}).get("is_ratio_ess"), c.adaptive_async, c.max_async_level
        )
        if self.async_level.level != before.level:
            log.info(
                "async level %d -> %d (trainer ESS %.4f at policy version %d, target %.4f)",
                before.level,
                self.async_level.level,
                self.async_level.last_ess,
                version,
                c.adaptive_async.target_ess,
            )

    def _notice_waiting(self, step: int, blocked: bool) -> None:
        c, sched = self.config, self.scheduler
        if blocked:
            log.info(
                "step %d waits for the trainer's weights of step %d", step, step - self.async_level.level
            )
        elif self.pool.pick() is None:
            log.info("step %d waits for an inference server to come back", step)
        else:
            last = sched.last_failure
            last_error = f"; last failure: {last}" if last else ""
            log.info(
                "step %d still collecting: %d/%d rollouts ready, %d in flight, %d failed so far%s",
                step,
                sched.ready_rollouts,
                c.batch_size,
                sched.inflight_rollouts,
                sum(sched.acc.buckets["failed"].values()),
                last_error[:300],
            )


def waiting_for(step: int, weights: int, blocked: bool) -> tuple[str, str]:
    """What the step loop waits for while it collects (activity record: words, the kind waited for)."""
    if blocked:
        return f"step {step}: waiting for the trainer's weights of step {weights}", "trainer"
    if slow := slow_call():  # the env side in this process: its tools' sandbox may hold it up
        return f"step {step}: collecting rollouts, waiting on {slow}", "sandbox"
    return f"step {step}: collecting rollouts", "inference"
