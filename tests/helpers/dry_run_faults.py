"""Test-only faults planted in the trainer for `fake_gpu_test.py`, each run in a process of its own
(the fake GPU's registration with torch lasts for the process).

    python tests/helpers/dry_run_faults.py collective MODEL_DIR

`collective`: the trainer's all-reduces get CPU copies of their tensors, as its global token count
did before its CUDA path was checked. (A CPU tensor in a device op is planted through a loss
plugin: `cpu_loss` below.)
"""

from __future__ import annotations

import sys
import tempfile

import torch


def cpu_loss(inputs, **kwargs):
    """A user's loss plugin that builds a tensor without a device: it works on CPU, not on a GPU."""
    from prime_rl.trainer.losses import LossOutputs

    weight = torch.ones(inputs.loss_mask.shape[0])  # on the CPU, whatever the trainer's device
    return LossOutputs(-inputs.trainer_logprobs * inputs.advantages * inputs.loss_mask * weight)


def main() -> None:
    fault, model = sys.argv[1], sys.argv[2]
    from prime_rl.trainer import trainer
    from prime_rl.trainer.config import TrainerConfig
    from prime_rl.trainer.dist import exit_now
    from prime_rl.trainer.dry_run import DryRunError, dry_run

    if fault != "collective":
        raise SystemExit(f"unknown fault {fault!r}")
    real = trainer.all_reduce_sum
    trainer.all_reduce_sum = lambda value, world: real(value.cpu(), world)
    config = TrainerConfig(model={"name": model}, seq_len=128, output_dir=tempfile.mkdtemp())
    try:
        dry_run(config, dp=2, cp=1)
    except DryRunError as e:
        print(f"caught: {e}")
        exit_now(1)
    print("not caught")
    exit_now(0)


if __name__ == "__main__":
    main()
