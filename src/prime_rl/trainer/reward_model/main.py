"""`uv run train-reward-model @ rm.toml`: train a scalar reward model on preference pairs.

A pair is a prompt with a chosen and a rejected completion; the loss is Bradley-Terry's,
-log sigmoid(r(chosen) - r(rejected)). Pairs come from a JSONL file or from an env module's
`preference_pairs(num_pairs, seed)`. The model starts from a causal LM folder (its body and
tokenizer, a new one-output head) and is saved as an HF sequence-classification folder that the
orchestrator's reward model (a `rewards` entry of type `reward_model`) and `reward-server` load.

Training is the trainer's step (`trainer/step.py`) with the Bradley-Terry objective
(`reward_model/objective.py`): FSDP2 over torchrun's ranks, data and context parallelism, the
global normalization, clipping, AdamW and its schedule, and the trainer's checkpoints
(`ckpt.interval`, `ckpt.resume_step`).

Invariant: held-out pairs never train (the split is fixed by the seed), and the accuracy printed is
on them; the same config and seed give the same model, on any number of ranks (up to float
rounding) and whether or not the run was stopped and resumed from a checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from prime_rl.config import parse_config
from prime_rl.runtime.logging_setup import setup_logging
from prime_rl.runtime.shutdown import Stopped, exit_stopped, take_signals
from prime_rl.trainer.loop import Steps, metrics_log, resume, train_loop
from prime_rl.trainer.memory import keep_freed_memory
from prime_rl.trainer.parallel.dist import World, init_world, init_world_or_exit, run_rank
from prime_rl.trainer.reward_model.config import RewardModelTrainConfig
from prime_rl.trainer.reward_model.data import PairsError, pack_pairs, pair_stream, read_pairs, split_pairs
from prime_rl.trainer.reward_model.objective import BradleyTerry, save_reward_model
from prime_rl.trainer.run import NEEDS_USER, USER_ERRORS
from prime_rl.trainer.weights.checkpoint import Checkpointer, checkpoint_root
from prime_rl.transport.messages import MicroBatch

__all__ = ["PairsError", "RewardModelTrainConfig", "main", "read_pairs", "train"]

log = logging.getLogger("prime_rl.reward_model")


def save_dir(config: RewardModelTrainConfig) -> Path:
    return Path(config.output or Path(config.output_dir) / "reward_model" / "model")


def step_line(step: int, figures: dict[str, float]) -> str:
    held_out = f" | held-out accuracy {figures['eval/accuracy']:.3f}" if "eval/accuracy" in figures else ""
    return (
        f"step {step} | loss {figures['loss']:.4f} | accuracy {figures['accuracy']:.3f} | "
        f"grad_norm {figures['grad_norm']:.3f}{held_out} | {figures['time/step']:.1f}s"
    )


def train(config: RewardModelTrainConfig, world: World | None = None) -> dict[str, float]:
    """Train, save the reward model, and return its held-out figures: start_accuracy (the untrained
    model's), accuracy and margin (the saved model's), seconds."""
    import torch
    from transformers import AutoTokenizer

    if config.threads:
        torch.set_num_threads(config.threads)
    world = world or init_world(config.parallel.cp, config.parallel.ep, config.dist_timeout_s)
    keep_freed_memory(world)
    output_dir = Path(config.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(config.model.name)
    train_pairs, held_out = split_pairs(config.data, tokenizer, config.max_length, config.seed)
    rm = BradleyTerry(config, world)
    eval_batches = pack_pairs(held_out, config.seq_len, world.dp, "reward_model-eval", 0)[world.dp_rank]
    started = time.perf_counter()
    # The fresh model is the same in every run of this config, so a resumed run measures it again
    # rather than keeping it in the checkpoint.
    first = rm.evaluate(eval_batches)
    log.info(
        "%d training pairs, %d held out; held-out accuracy %.3f, margin %.3f before training",
        len(train_pairs),
        len(held_out),
        first["accuracy"],
        first["margin"],
    )
    position = {"pairs": 0}  # where the pair stream stands: kept in the checkpoints
    checkpointer = Checkpointer(
        checkpoint_root(output_dir), world, config.ckpt.keep, rm.model, rm.optimizer, rm.scheduler,
        state=lambda: dict(position),
    )  # fmt: skip
    start, state = resume(config, world, checkpointer)
    # (a checkpoint from before the position was kept: every step took batch_size pairs)
    position["pairs"] = state.get("pairs", start * config.batch_size)
    stream = pair_stream(train_pairs, config.seed, position["pairs"])
    metrics = metrics_log(
        world, output_dir / "reward_model" / "metrics.jsonl", start, config.wandb, evals=True
    )
    held = None

    def batches(step: int) -> list[MicroBatch]:
        batch = [next(stream) for _ in range(config.batch_size)]
        position["pairs"] += len(batch)
        return pack_pairs(batch, config.seq_len, world.dp, "reward_model", step)[world.dp_rank]

    def evaluation(step: int, figures: dict[str, float], records: list) -> dict[str, float]:
        nonlocal held
        if (step + 1) % config.eval_interval and step + 1 != config.max_steps:
            return {}
        held = rm.evaluate(eval_batches)
        return {f"eval/{k}": v for k, v in held.items()}

    steps = Steps(batches, step_line, evaluation, logger="prime_rl.reward_model")
    train_loop(config, world, rm, checkpointer, start, steps, metrics)
    if held is None:  # resumed from the last step's checkpoint: nothing trained here
        held = rm.evaluate(eval_batches)
    out = save_dir(config)
    save_reward_model(rm.model, config, tokenizer, out, world)
    result = {
        "start_accuracy": first["accuracy"],
        "accuracy": held["accuracy"],
        "margin": held["margin"],
        "seconds": time.perf_counter() - started,
    }
    if metrics is not None:
        metrics.close()
        (out / "reward_model_eval.json").write_text(json.dumps(result, indent=2) + "\n")
        log.info("saved the reward model to %s", out)
    return result


def main(argv: list[str] | None = None) -> None:
    # Ctrl-C or SIGTERM stops every rank with one line (`prime_rl.runtime.shutdown`); a checkpoint being
    # written when it comes is never resumed from (`weights/checkpoint.py`).
    setup_logging("reward_model")
    take_signals(announce=os.environ.get("RANK", "0") == "0")
    try:
        config = parse_config(RewardModelTrainConfig, argv, prog="train-reward-model")
        world = init_world_or_exit(
            config.parallel.cp, "train-reward-model", config.parallel.ep, config.dist_timeout_s
        )
    except Stopped:  # before the ranks' work (`run_rank` says the line from there on)
        exit_stopped()
    setup_logging(f"reward_model[{world.rank}]" if world.distributed else "reward_model")

    def run() -> None:
        result = train(config, world)
        if world.is_main:
            print(
                f"train-reward-model: wrote {save_dir(config)}; held-out accuracy "
                f"{result['start_accuracy']:.3f} -> {result['accuracy']:.3f}"
            )

    run_rank(world, "train-reward-model", run, (*USER_ERRORS, PairsError), (*NEEDS_USER, PairsError))


if __name__ == "__main__":
    main()
