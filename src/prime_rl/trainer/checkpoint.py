"""Trainer checkpoints: model, optimizer, scheduler, step and RNG (and the critic and its optimizer,
and the KL controller, when configured), to resume a killed trainer.

Layout: `<output_dir>/checkpoints/step_<N>/` (the state after N optimizer steps) with the sharded
model and optimizer state (torch.distributed.checkpoint, one shard per rank), `rank_<r>.pt` with the
scheduler, step and RNG states, and `DONE`, written last. Invariant: only a folder with `DONE` is
ever resumed from, so a trainer killed while saving resumes from the previous checkpoint.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from prime_rl.layout import DONE, checkpoint_root, complete_steps
from prime_rl.trainer.dist import World

__all__ = ["checkpoint_root", "complete_steps", "load_checkpoint", "save_checkpoint"]


def _barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def _sharded_state(model, optimizer, critic) -> dict:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    if critic is not None:
        state["critic"], state["critic_optim"] = get_state_dict(*critic)
    return state


def save_checkpoint(
    root: Path, step: int, model, optimizer, scheduler, world: World, keep: int, critic=None, extra=None
) -> Path:
    """`critic`: (value model, its optimizer), saved beside the policy; `extra`: small picklable
    state that every rank holds the same (e.g. the KL controller), returned by `load_checkpoint`."""
    path = root / f"step_{step}"
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
        (path / DONE).touch()
        for old in complete_steps(root)[:-keep]:
            shutil.rmtree(root / f"step_{old}", ignore_errors=True)
    _barrier(world)
    return path


def load_checkpoint(root: Path, step: int, model, optimizer, scheduler, world: World, critic=None) -> dict:
    """Restore everything `save_checkpoint` wrote; returns its `extra`."""
    path = root / f"step_{step}"
    if not (path / DONE).exists():
        raise FileNotFoundError(f"no complete checkpoint at {path} (complete ones: {complete_steps(root)})")
    state = _sharded_state(model, optimizer, critic)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if critic is not None:
        set_state_dict(*critic, model_state_dict=state["critic"], optim_state_dict=state["critic_optim"])
    saved = torch.load(path / f"rank_{world.rank}.pt", weights_only=False)
    scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"]["torch"])
    random.setstate(saved["rng"]["python"])
    return saved.get("extra", {})
