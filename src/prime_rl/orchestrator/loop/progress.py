"""The orchestrator's progress checkpoint, so a restarted orchestrator resumes where it stopped.

`<output_dir>/orchestrator/progress.json` holds the next step to build, the bucket counts, each
env's dataset cursor, the RNG state and the difficulty filter's memory; `batches/step_<N>.msgpack` holds the training batches of the
steps the trainer may not have finished. Invariant: progress is saved (atomically) after a step's
batch, rollouts and metrics record are written and before the batch is sent; that save is the step's
commit point. After a crash the restarted orchestrator drops the metrics of uncommitted steps, re-sends exactly
the saved batches from the trainer's oldest kept checkpoint on (the trainer ignores a step it already has)
and continues with the next step: no step is skipped, and no step is trained on two different
batches. The rollouts in flight or waiting for a batch at the crash count as stale, and their
examples, with those waiting to be dispatched again (lost with a server), are dispatched first by
the restarted orchestrator (`Progress.again`): no example is lost to a crash.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prime_rl.orchestrator.loop.examples import Cursor
from prime_rl.orchestrator.loop.scheduler import BUCKETS, Accounting
from prime_rl.orchestrator.messages import Example
from prime_rl.runtime.monitor import forget_steps_from
from prime_rl.transport.base import TransportError
from prime_rl.transport.file_transport import seal, unseal, write_atomic
from prime_rl.transport.messages import TrainingBatch, decode, encode

log = logging.getLogger("prime_rl.orchestrator")

KEEP_BATCHES = 4
"""Saved batches kept before the oldest kept trainer checkpoint (a margin: that checkpoint is only
deleted once a newer one is complete)."""


@dataclass
class Progress:
    step: int = 0
    """The next step to build."""
    accounting: dict[str, dict[str, int]] = field(default_factory=dict)
    cursors: dict[str, list[int]] = field(default_factory=dict)
    rng_state: Any = None
    difficulty: dict[str, dict[str, float]] = field(default_factory=dict)
    """The difficulty filter's memory: env -> example id -> last pass rate (skipped examples only)."""
    again: list[list] = field(default_factory=list)
    """[env name, example id, task data] of the examples to dispatch first on resume: those in flight, or
    back and not yet in a batch, at the commit, and those waiting to be dispatched again."""


def progress_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "orchestrator"


def save_progress(output_dir: Path, progress: Progress) -> None:
    write_atomic(progress_dir(output_dir) / "progress.json", json.dumps(asdict(progress)).encode())


def load_progress(output_dir: Path) -> Progress | None:
    path = progress_dir(output_dir) / "progress.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    known = Progress.__dataclass_fields__
    return Progress(**{k: v for k, v in data.items() if k in known})


def batch_path(output_dir: Path, step: int) -> Path:
    return progress_dir(output_dir) / "batches" / f"step_{step:06d}.msgpack"


def save_batch(output_dir: Path, batch: TrainingBatch, keep_from: int = 0) -> None:
    """Save a step's batch; forget batches the trainer finished long ago (before `keep_from` - KEEP)."""
    path = batch_path(output_dir, batch.header.step)
    write_atomic(path, seal(Path(output_dir), path, encode(batch)))
    for path in batch_path(output_dir, 0).parent.glob("step_*.msgpack"):
        if int(path.stem.removeprefix("step_")) < keep_from - KEEP_BATCHES:
            path.unlink(missing_ok=True)


def load_batch(output_dir: Path, step: int) -> TrainingBatch | None:
    path = batch_path(output_dir, step)
    if not path.exists():
        return None
    try:  # a batch someone else planted is never re-sent: the step is made anew
        batch = decode(unseal(Path(output_dir), path, path.read_bytes()))
    except TransportError as e:
        log.warning("%s", e)
        return None
    assert isinstance(batch, TrainingBatch)
    return batch


def rng_to_json(rng: random.Random) -> Any:
    version, state, gauss = rng.getstate()
    return [version, list(state), gauss]


def rng_from_json(data: Any) -> random.Random:
    rng = random.Random()
    rng.setstate((data[0], tuple(data[1]), data[2]))
    return rng


def cursor_from_json(data: list[int] | None) -> Cursor | None:
    return Cursor(*data) if data else None


def again_from_json(entries: list[list]) -> list[tuple[str, Example]]:
    """`Progress.again` as (env name, example). Entries of a version before tasks travelled
    ([env name, dataset index]) cannot be found again: they are dropped, with a warning."""
    out = [(e[0], Example(e[1], e[2])) for e in entries if len(e) == 3]
    if len(out) < len(entries):
        log.warning(
            "%d example(s) to dispatch again were saved by an older version (by dataset index): "
            "not dispatched again",
            len(entries) - len(out),
        )
    return out


class RunDirError(RuntimeError):
    """The output folder does not fit the requested start (fresh or resumed)."""


def restore(config) -> tuple[Progress, random.Random, Accounting]:
    """Where an orchestrator of this config starts: fresh, or from its progress checkpoint (the
    rollouts in flight when the previous process died are counted as stale)."""
    output_dir = Path(config.output_dir)
    if not config.resume:
        leftovers = [
            p for p in ("orchestrator/progress.json", "weights", "transport") if (output_dir / p).exists()
        ]
        if leftovers:
            raise RunDirError(
                f"output_dir '{output_dir}' holds a previous run ({', '.join(leftovers)}) and resume = false: "
                "choose a new output_dir, delete the old one, or set resume = true to continue it"
            )
    progress = load_progress(output_dir) if config.resume else None
    if progress is None:
        return Progress(), random.Random(config.seed), Accounting()
    acc = Accounting.from_snapshot(progress.accounting)
    for env, n in acc.dispatched.items():
        acc.add("stale", env, n - sum(acc.buckets[b][env] for b in BUCKETS))
    log.info("resuming at step %d from %s", progress.step, output_dir / "orchestrator")
    return progress, rng_from_json(progress.rng_state), acc


def forget_uncommitted(output_dir: Path, next_step: int) -> None:
    """A killed process may have logged a step it had not yet committed: it is built again, so its
    record goes. Evals are kept, as they are not run again on resume, except the one at the start."""
    path = Path(output_dir) / "orchestrator" / "metrics.jsonl"
    dropped = forget_steps_from(path, next_step, evals=next_step == 0)
    if dropped:
        log.info("dropped %d metrics record(s) of steps from %d, which are built again", dropped, next_step)
