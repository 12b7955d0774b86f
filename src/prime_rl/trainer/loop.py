"""The one step loop of every trainer (`trainer`, `sft`, `train-reward-model`): resume from the
checkpoint, then per step take this rank's micro-batches, train, add what the kind of training adds
(publish the weights, export tokens, evaluate), log one line, and checkpoint at the interval.

Invariants:
- a step's checkpoint, its commit point, is written after its metrics line: a kill after it loses
  nothing, a kill before it has the step trained and logged again on resume (the metrics file
  forgets the steps from the resumed one on, `metrics_log`);
- a step whose loss or gradient norm is not finite changes no parameter and no schedule
  (`step.settle`); `max_nan_steps` such steps in a row end the run with one line (`NaNLossError`);
- running out of memory ends the run with one line that says how to fit; a failed collective, with
  one line naming the step and the timeout's config key.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from prime_rl.runtime import activity
from prime_rl.trainer.config import TrainingConfig
from prime_rl.trainer.memory import is_out_of_memory, out_of_memory
from prime_rl.trainer.parallel.dist import World, collective_error, collective_failure
from prime_rl.trainer.run import NaNLossError, resume_step
from prime_rl.trainer.weights.checkpoint import Checkpointer
from prime_rl.transport.messages import MicroBatch


class Trained(Protocol):
    """What the loop trains: one kind of training's modules and objective."""

    def train_step(self, micro_batches: list[MicroBatch], step: int) -> tuple[dict[str, float], list[Any]]:
        """One optimizer step on this rank's micro-batches: (metrics, the micro-batches' records)."""
        ...


@dataclass(frozen=True)
class Steps:
    """What one kind of training gives the loop besides its objective."""

    batches: Callable[[int], list[MicroBatch]]
    """This rank's micro-batches of a step; the time it takes is the step's `time/wait_for_data`."""
    line: Callable[[int, dict[str, float]], str]
    """The step's log line, from its metrics (written by the main rank)."""
    after: Callable[[int, dict[str, float], list[Any]], dict[str, float]] | None = None
    """Once a step trained (its metrics, its records): what the kind adds (publish the weights,
    export tokens, evaluate; may run collectives), and the figures that adds to the step's metrics."""
    logger: str = "prime_rl.trainer"
    timeout_key: str = "dist_timeout_s"
    """The config key a failed collective's line names."""


def resume(config: TrainingConfig, world: World, checkpointer: Checkpointer) -> tuple[int, dict]:
    """(the step to start at, the checkpoint's `state`): 0 and {} for a fresh run, else the
    checkpoint of `ckpt.resume_step` loaded."""
    start = resume_step(config, world)
    if not start:
        return 0, {}
    state = checkpointer.load(start)
    if world.is_main:
        logging.getLogger("prime_rl.trainer").info("resumed from checkpoint step %d", start)
    return start, state


def train_loop(
    config: TrainingConfig,
    world: World,
    trained: Trained,
    checkpointer: Checkpointer,
    start: int,
    steps: Steps,
    metrics_log=None,
) -> None:
    """Steps `start` to `max_steps - 1`; `metrics_log`: the main rank's (`metrics_log`), None on the
    others."""
    log = logging.getLogger(steps.logger)
    nan_streak = 0
    t0, t_ckpt = time.perf_counter(), 0.0
    step = start
    try:
        for step in range(start, config.max_steps):
            t_get = time.perf_counter()
            micro_batches = steps.batches(step)
            t_wait = time.perf_counter() - t_get
            activity.doing(f"step {step}: training", "", step)
            metrics, records = train(trained, micro_batches, step, config, world)
            nan_streak = nan_streak + 1 if skipped(metrics) else 0
            if nan_streak:
                log.warning(
                    "step %d: non-finite loss or gradient, update skipped (%d in a row)", step, nan_streak
                )
            if nan_streak >= config.max_nan_steps:
                raise NaNLossError(
                    f"{nan_streak} consecutive steps had a non-finite loss or gradient norm (max_nan_steps)"
                )
            if steps.after is not None:
                metrics.update(steps.after(step, metrics, records))
            metrics["time/wait_for_data"] = t_wait
            metrics["time/checkpoint"] = t_ckpt  # the previous step's, which this step's clock includes
            metrics["time/step"] = time.perf_counter() - t0
            if step > start:  # the first holds the load and the first rollouts: no measure of a step
                activity.step_took(metrics["time/step"])
            if metrics_log is not None:
                metrics_log.log(step, metrics)
                log.info(steps.line(step, metrics))
            t0, t_ckpt = time.perf_counter(), 0.0
            if config.ckpt.interval and (step + 1) % config.ckpt.interval == 0:
                activity.doing(f"step {step}: writing the checkpoint of step {step + 1}", "", step, io=True)
                checkpointer.save(step + 1)
                t_ckpt = time.perf_counter() - t0
    except RuntimeError as e:
        if not world.distributed or not collective_failure(e):
            raise
        raise collective_error(e, world, steps.timeout_key, step) from None


def train(
    trained: Trained, micro_batches: list[MicroBatch], step: int, config: TrainingConfig, world: World
) -> tuple[dict[str, float], list[Any]]:
    """`trained.train_step`, with running out of memory said in one line that says how to fit."""
    try:
        return trained.train_step(micro_batches, step)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not is_out_of_memory(e):
            raise
        longest = max((mb.num_tokens for mb in micro_batches), default=0)
        raise out_of_memory(e, config, step, longest, world.world_size) from None


def skipped(metrics: dict[str, float]) -> bool:
    """Whether the step skipped an update for a non-finite loss or gradient norm (`step.settle`)."""
    return not math.isfinite(metrics["loss"]) or metrics.get("nonfinite_updates", 0.0) > 0


def metrics_log(world: World, path: Path, start: int, wandb, evals: bool = False, config: dict | None = None):
    """The main rank's metrics file (and W&B run), without the records of `start` and later, which
    the loop is about to log again (evaluation records too with `evals`); None on the other ranks."""
    if not world.is_main:
        return None
    from prime_rl.runtime.monitor import MetricsLogger, forget_steps_from

    forget_steps_from(path, start, evals=evals)
    return MetricsLogger(path, wandb, config=config)
