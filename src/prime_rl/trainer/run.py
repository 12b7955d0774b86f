"""What every training entry point shares (`trainer`, `sft`, `train-reward-model`): where a run
resumes, and which errors end it with one line.

Invariant: every rank resumes from the same step, the one rank 0 verified; an error in
`USER_ERRORS` is the user's to see as one line without a traceback, and one in `NEEDS_USER` is not
retried by `rl` (exit status 2).
"""

from __future__ import annotations

import logging

import torch

from prime_rl.config.plugins import PluginError
from prime_rl.runtime.disk import DiskFull
from prime_rl.runtime.secret import SecretError
from prime_rl.trainer.config import TrainingConfig
from prime_rl.trainer.data import OutsideTheModel, SampleTooLong
from prime_rl.trainer.estimators.base import TokenAdvantageError
from prime_rl.trainer.memory import OutOfMemory
from prime_rl.trainer.model import ModelLoadError
from prime_rl.trainer.parallel.dist import FILE_WORK_TIMEOUT_S, World, patient
from prime_rl.trainer.weights.checkpoint import CheckpointError, checkpoint_root, choose_checkpoint
from prime_rl.transport.base import TransportError
from prime_rl.transport.contract import ContractError

log = logging.getLogger("prime_rl.trainer")


class NaNLossError(RuntimeError):
    """Too many consecutive steps had a non-finite loss."""


def resume_step(config: TrainingConfig, world: World) -> int:
    """The checkpoint step to resume from (0 = start fresh): rank 0 verifies, every rank takes its word."""
    choice: list = [None]
    if world.is_main:
        try:
            step, warnings = choose_checkpoint(checkpoint_root(config.output_dir), config.ckpt.resume_step)
            for w in warnings:
                log.warning(w)
            choice = [step]
        except CheckpointError as e:
            choice = [e]
    if world.distributed:
        # The other ranks wait while rank 0 reads the whole checkpoint to verify it.
        with patient(world, FILE_WORK_TIMEOUT_S if not world.is_main else 0.0):
            torch.distributed.broadcast_object_list(choice, src=0)
    if isinstance(choice[0], BaseException):
        raise CheckpointError(str(choice[0]))
    return choice[0]


NEEDS_USER = (
    ContractError,
    SampleTooLong,
    OutsideTheModel,
    OutOfMemory,
    ModelLoadError,
    NaNLossError,
    CheckpointError,
    PluginError,
    TokenAdvantageError,
    DiskFull,
    SecretError,
)
USER_ERRORS = (*NEEDS_USER, TransportError)
