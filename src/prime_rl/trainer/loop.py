"""The step loop of the trainers that read their data themselves (`sft`, `train-reward-model`):
resume, train each step on the batches its number selects, checkpoint at the interval.

Invariant: a step's checkpoint, its commit point, is written only after the caller has had the
step's metrics (and logged them): `train_steps` yields a step's metrics and writes its checkpoint
when the caller asks for the next step. So a kill after a checkpoint loses nothing, and a kill
before it has the step trained and logged again on resume (the metrics file forgets it first).
A failed collective ends the loop with one line naming the step and `dist_timeout_s`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from prime_rl.trainer.config import TrainingConfig
from prime_rl.trainer.parallel.dist import World, collective_error, collective_failure
from prime_rl.trainer.run import resume_step
from prime_rl.trainer.weights.checkpoint import checkpoint_root, load_checkpoint, save_checkpoint
from prime_rl.transport.messages import MicroBatch


class Trained(Protocol):
    """What the loop trains and checkpoints: an objective's model, optimizer and schedule."""

    model: object
    optimizer: object
    scheduler: object

    def train_step(self, micro_batches: list[MicroBatch]) -> dict[str, float]: ...


def resume(config: TrainingConfig, world: World, trained: Trained) -> int:
    """The step to start at: 0, or the checkpoint's (`ckpt.resume_step`), loaded into `trained`."""
    start = resume_step(config, world)
    if start:
        root = checkpoint_root(Path(config.output_dir))
        load_checkpoint(root, start, trained.model, trained.optimizer, trained.scheduler, world)
    return start


def train_steps(
    config: TrainingConfig,
    world: World,
    trained: Trained,
    start: int,
    batches: Callable[[int], list[MicroBatch]],
    also: Callable[[int], dict[str, float]] | None = None,
) -> Iterator[tuple[int, dict[str, float]]]:
    """(step, metrics) for steps `start` to `max_steps - 1`: each trained on `batches(step)`, with
    `also(step)`'s figures (e.g. a held-out evaluation, which may run collectives) added."""
    step = start
    try:
        for step in range(start, config.max_steps):
            metrics = trained.train_step(batches(step))
            if also is not None:
                metrics.update(also(step))
            yield step, metrics
            if config.ckpt.interval and (step + 1) % config.ckpt.interval == 0:
                save_checkpoint(
                    checkpoint_root(Path(config.output_dir)),
                    step + 1,
                    trained.model,
                    trained.optimizer,
                    trained.scheduler,
                    world,
                    config.ckpt.keep,
                )
    except RuntimeError as e:
        if not world.distributed or not collective_failure(e):
            raise
        raise collective_error(e, world, "dist_timeout_s", step) from None


def metrics_log(world: World, path: Path, start: int, wandb, evals: bool = False):
    """The main rank's metrics file (and W&B run), without the records of `start` and later, which
    the loop is about to log again (evaluation records too with `evals`); None on the other ranks."""
    if not world.is_main:
        return None
    from prime_rl.monitor import MetricsLogger, forget_steps_from

    forget_steps_from(path, start, evals=evals)
    return MetricsLogger(path, wandb)
