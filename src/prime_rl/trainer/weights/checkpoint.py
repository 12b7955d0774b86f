"""Trainer checkpoints: model, optimizer, scheduler, step and RNG (and the critic and its optimizer,
and the KL controller, when configured), to resume a killed trainer.

Layout: `<output_dir>/checkpoints/step_<N>/` (the state after N optimizer steps) with the sharded
model and optimizer state (torch.distributed.checkpoint, one shard per rank), `rank_<r>.pt` with the
scheduler, step and RNG states, `MANIFEST.json` (every file's size and hash, keyed by the run secret
when there is one: `prime_rl.runtime.layout`) and `DONE`, written last, by rank 0 while the others wait.
Invariants: only a folder with `DONE` is ever resumed from, so a trainer killed while saving
resumes from the previous checkpoint; a resume verifies the checkpoint against its manifest first,
and `choose_checkpoint` falls back from a damaged newest one to the newest intact one (an explicit
step that is damaged is an error), with a warning naming the file that does not match. A checkpoint
that someone without the run secret changed is damaged in this sense: it takes the same path. The
newest `ckpt.keep` complete checkpoints are kept.
"""

from __future__ import annotations

import pickle
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from prime_rl.runtime.disk import writing
from prime_rl.runtime.layout import DONE, checkpoint_root, complete_steps, verify_checkpoint, write_manifest
from prime_rl.trainer.parallel.dist import FILE_WORK_TIMEOUT_S, World, patient
from prime_rl.trainer.weights.no_pickle import NotState, SafePlanner, SafeReader, load_weights_only

__all__ = ["Checkpointer", "checkpoint_root", "choose_checkpoint", "complete_steps"]


class CheckpointError(RuntimeError):
    """The requested checkpoint does not exist, is damaged, or does not load."""


def choose_checkpoint(root: Path, wanted: int | None) -> tuple[int, list[str]]:
    """The step to resume from (0: start fresh) and the warnings to show. `wanted`: None starts
    fresh, -1 takes the newest checkpoint that verifies (skipping damaged newer ones, each named in
    a warning), a step takes exactly that one (`CheckpointError` if it is missing or damaged)."""
    if wanted is None:
        return 0, []
    steps = complete_steps(root)
    if wanted != -1:
        if wanted not in steps:
            raise CheckpointError(
                f"ckpt.resume_step = {wanted}, but the complete checkpoints in {root} are {steps or 'none'}"
            )
        problem = verify_checkpoint(root / f"step_{wanted}")
        if problem:
            raise CheckpointError(f"ckpt.resume_step = {wanted}: the checkpoint is unreadable: {problem}")
        return wanted, []
    damaged = []
    for step in reversed(steps):
        problem = verify_checkpoint(root / f"step_{step}")
        if problem is None:
            return step, [
                f"checkpoint step {bad} is unreadable ({why}); resuming from step {step} instead"
                for bad, why in damaged
            ]
        damaged.append((step, problem))
    if damaged:  # starting over would need batches long deleted: the user must decide
        raise CheckpointError(
            f"no checkpoint in {root} is readable ({'; '.join(f'step {s}: {why}' for s, why in damaged)}); "
            "set ckpt.resume_step to start over elsewhere, or restore one"
        )
    return 0, []


def _barrier(world: World) -> None:
    """The other ranks wait here for rank 0's work on the checkpoint's files (removing a step, writing
    the manifest, which reads every file): it grows with the model, so they wait up to
    FILE_WORK_TIMEOUT_S; rank 0's own side waits as usual."""
    if world.distributed:
        with patient(world, FILE_WORK_TIMEOUT_S if not world.is_main else 0.0):
            dist.barrier()


TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
"""Frozen parameters (the base weights under LoRA adapters) come from the model, never a checkpoint."""

LOAD_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)
"""Setting the trained parameters leaves the frozen ones missing, by design; a trained one missing
from the checkpoint already failed `dcp.load`, which fills every key of the state it is given."""


def _sharded_state(model, optimizer, critic) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    state = {"model": model_sd, "optim": optim_sd}
    if critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(*critic, options=TRAINED_ONLY)
    return state


@dataclass
class Checkpointer:
    """A run's checkpoints: everything it resumes from, saved after a step and loaded on resume in
    one call each."""

    root: Path
    """`<output_dir>/checkpoints` (`checkpoint_root`)."""
    world: World
    keep: int
    """How many complete checkpoints to keep (`ckpt.keep`)."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    critic: tuple[torch.nn.Module, torch.optim.Optimizer] | None = None
    """(value model, its optimizer), saved beside the policy."""
    state: Callable[[], dict] = field(default=dict)
    """Small picklable state that every rank holds the same (the KL controller's, where the data
    stream stands), taken at each save and returned by `load`."""

    def save(self, step: int) -> Path:
        """The state after `step` optimizer steps, as `<root>/step_<step>` (a collective: every rank
        calls it)."""
        parts = (self.model, self.optimizer, self.scheduler)
        return _save(self.root, step, *parts, self.world, self.keep, self.critic, self.state())

    def load(self, step: int) -> dict:
        """Restore the modules, optimizers, schedule and RNG of `<root>/step_<step>`; its `state`."""
        parts = (self.model, self.optimizer, self.scheduler)
        return _load(self.root, step, *parts, self.world, self.critic)


def _save(root: Path, step: int, model, optimizer, scheduler, world: World, keep: int, critic, extra) -> Path:
    path = root / f"step_{step}"
    with writing(path, f"the checkpoint of step {step}"):
        if world.is_main and path.exists():
            shutil.rmtree(path)
        _barrier(world)
        dcp.save(_sharded_state(model, optimizer, critic), checkpoint_id=str(path))
        torch.save(
            {
                "step": step,
                "scheduler": scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
                "extra": extra or {},
            },
            path / f"rank_{world.rank}.pt",
        )
        _barrier(world)
        if world.is_main:
            write_manifest(path)
            (path / DONE).touch()
            for old in complete_steps(root)[:-keep]:
                shutil.rmtree(root / f"step_{old}", ignore_errors=True)
        _barrier(world)
    return path


def _reason(e: BaseException) -> str:
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]  # the first rank's (exception, traceback)
    return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


class DCPAssertion(Exception):
    """An AssertionError raised by torch.distributed.checkpoint itself about the checkpoint (a metadata
    read that failed every way), as opposed to an assertion failing in our code."""


def _unwrap_dcp(e: BaseException) -> BaseException:
    """What failed, where DCP reports it as an AssertionError of its own: in one process its collective
    helper asserts on the result of a step that raised (the CheckpointException is the assertion's
    context), and a metadata read that failed every way is an assertion naming the causes. Any other
    exception, an assertion of our code's included, is returned as is."""
    if not isinstance(e, AssertionError) or e.__traceback__ is None:
        return e
    tb = e.__traceback__
    while tb.tb_next is not None:
        tb = tb.tb_next
    if "torch/distributed/checkpoint/" not in tb.tb_frame.f_code.co_filename.replace("\\", "/"):
        return e
    if isinstance(e.__context__, CheckpointException):
        return e.__context__
    return DCPAssertion(str(e))


def _planted(e: BaseException, *loaders) -> NotState | None:
    """The refusal of a payload that is not checkpoint state (`no_pickle.py`): raised, kept by one of
    the `loaders` (DCP reports a refused metadata read as an assertion of its own), or wrapped by DCP
    into its error for one rank; None for any other failure."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    if isinstance(e, NotState):
        return e
    return next((loader.refused for loader in loaders if loader.refused is not None), None)


def _load(root: Path, step: int, model, optimizer, scheduler, world: World, critic) -> dict:
    """Restore everything `_save` wrote; returns its `extra`."""
    path = root / f"step_{step}"
    if not (path / DONE).exists():
        raise CheckpointError(f"no complete checkpoint at {path} (complete ones: {complete_steps(root)})")
    state = _sharded_state(model, optimizer, critic)
    reader, planner = SafeReader(str(path)), SafePlanner()
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=LOAD_TRAINED,
        )
        if critic is not None:
            set_state_dict(
                *critic,
                model_state_dict=state["critic"],
                optim_state_dict=state["critic_optim"],
                options=LOAD_TRAINED,
            )
        saved = load_weights_only(path / f"rank_{world.rank}.pt")
    except torch.OutOfMemoryError:
        raise
    except (Exception, CheckpointException) as raised:  # (DCP's exception is a BaseException)
        e = _unwrap_dcp(raised)
        refusal = _planted(e, reader, planner)
        if refusal is not None:
            named = refusal.named or "a global torch's weights-only loader refuses"
            raise CheckpointError(
                f"the checkpoint {path} holds a pickled object that is not checkpoint state (it names {named}); "
                "refused: loading it could run the code of whoever wrote it"
            ) from None
        # Another model's, say, or full weights against adapters; anything else is a bug, raised as is.
        if isinstance(
            e,
            (
                pickle.UnpicklingError,
                CheckpointException,
                RuntimeError,
                KeyError,
                ValueError,
                EOFError,
                DCPAssertion,
            ),
        ):
            raise CheckpointError(
                f"the checkpoint {path} does not load into this trainer: {_reason(e)}"
            ) from None
        raise
    scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"]["torch"])
    random.setstate(saved["rng"]["python"])
    return saved.get("extra", {})
