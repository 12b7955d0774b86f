"""`uv run train-reward-model @ rm.toml`: train a scalar reward model on preference pairs.

A pair is a prompt with a chosen and a rejected completion; the loss is Bradley-Terry's,
-log sigmoid(r(chosen) - r(rejected)). Pairs come from a JSONL file or from an env module's
`preference_pairs(num_pairs, seed)`. The model starts from a causal LM folder (its body and
tokenizer, a new one-output head) and is saved as an HF sequence-classification folder that the
orchestrator's reward model (a `rewards` entry of type `reward_model`) and `reward-server` load.

Invariant: held-out pairs never train (the split is fixed by the seed), and the accuracy printed is
on them; the same config and seed give the same model.
"""

from __future__ import annotations

import importlib
import json
import logging
import random
import sys
import time
from typing import Any

from prime_rl.config import parse_config
from prime_rl.environments import env_module_name
from prime_rl.logging_setup import setup_logging
from prime_rl.model.reward import RewardModel, RewardModelError, init_reward_model, plain_messages
from prime_rl.trainer.reward_model.config import PairsConfig, RewardModelTrainConfig

log = logging.getLogger("prime_rl.reward_model")


class PairsError(ValueError):
    """The preference pairs cannot be read; the message names the file and line, or the env."""


def _messages(value: Any, role: str, where: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value):
        return plain_messages(value)
    raise PairsError(f"{where}: expected a string or a list of {{'role', 'content'}} messages")


def read_pairs(config: PairsConfig, seed: int) -> list[tuple[list[dict], list[dict], list[dict]]]:
    """Every pair as (prompt, chosen, rejected) message lists."""
    if config.path is not None:
        if not config.path.is_file():
            raise PairsError(f"data.path '{config.path}' not found")
        rows = []
        for i, line in enumerate(config.path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append((json.loads(line), f"{config.path}:{i}"))
                except json.JSONDecodeError as e:
                    raise PairsError(f"{config.path}:{i}: not JSON ({e})") from None
    else:
        name = env_module_name(config.env_id)
        try:
            module = importlib.import_module(name)
        except Exception as e:
            raise PairsError(f"data.env_id '{config.env_id}': module '{name}' does not import: {e}") from None
        make = getattr(module, "preference_pairs", None)
        if not callable(make):
            raise PairsError(
                f"data.env_id '{config.env_id}': module '{name}' has no preference_pairs(num_pairs, seed); "
                "give data.path instead"
            )
        rows = [(r, f"env '{config.env_id}' pair {i}") for i, r in enumerate(make(config.num_pairs, seed))]
    pairs = []
    for row, where in rows:
        if not isinstance(row, dict) or not {"prompt", "chosen", "rejected"} <= row.keys():
            raise PairsError(f"{where}: expected keys 'prompt', 'chosen' and 'rejected'")
        pairs.append(
            (
                _messages(row["prompt"], "user", f"{where} 'prompt'"),
                _messages(row["chosen"], "assistant", f"{where} 'chosen'"),
                _messages(row["rejected"], "assistant", f"{where} 'rejected'"),
            )
        )
    if len(pairs) < 2:
        raise PairsError("need at least 2 preference pairs (one to train, one to hold out)")
    return pairs


def accuracy(
    rm: RewardModel, pairs: list[tuple[list[int], list[int]]], batch_size: int
) -> tuple[float, float]:
    """Share of pairs whose chosen completion scores higher, and the mean margin."""
    import torch

    right, margin = 0, 0.0
    with torch.inference_mode():
        for i in range(0, len(pairs), batch_size):
            chunk = pairs[i : i + batch_size]
            scores = rm.forward([c for c, _ in chunk] + [r for _, r in chunk])
            diff = scores[: len(chunk)] - scores[len(chunk) :]
            right += int((diff > 0).sum())
            margin += float(diff.sum())
    return right / len(pairs), margin / len(pairs)


def train(config: RewardModelTrainConfig) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    if config.threads:
        torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    pairs = read_pairs(config.data, config.seed)
    try:
        rm = init_reward_model(config.base_model)
    except Exception as e:
        raise RewardModelError(
            f"base_model '{config.base_model}' does not load: {type(e).__name__}: {e}"
        ) from None
    rm.max_length = config.max_length
    encoded = [(rm.ids(p, c), rm.ids(p, r)) for p, c, r in pairs]
    random.Random(config.seed).shuffle(encoded)
    n_eval = max(1, int(len(encoded) * config.data.eval_fraction))
    held_out, train_pairs = encoded[:n_eval], encoded[n_eval:]
    log.info("%d training pairs, %d held out", len(train_pairs), len(held_out))

    rm.model.train()
    optim = torch.optim.AdamW(rm.model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    warmup = max(1, config.max_steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / warmup))
    rng = random.Random(config.seed + 1)
    acc, margin = accuracy(rm, held_out, config.batch_size)
    log.info("step 0: held-out accuracy %.3f, margin %.3f", acc, margin)
    result = {"start_accuracy": acc}
    order, pos, started = [], 0, time.perf_counter()
    for step in range(1, config.max_steps + 1):
        batch = []
        while len(batch) < config.batch_size:
            if pos >= len(order):
                order, pos = rng.sample(range(len(train_pairs)), len(train_pairs)), 0
            batch.append(train_pairs[order[pos]])
            pos += 1
        scores = rm.forward([c for c, _ in batch] + [r for _, r in batch])
        loss = -F.logsigmoid(scores[: len(batch)] - scores[len(batch) :]).mean()
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(rm.model.parameters(), 1.0)
        optim.step()
        sched.step()
        if step % config.eval_interval == 0 or step == config.max_steps:
            rm.model.eval()
            acc, margin = accuracy(rm, held_out, config.batch_size)
            rm.model.train()
            log.info(
                "step %d: loss %.4f, held-out accuracy %.3f, margin %.3f (%.1fs)",
                step, loss.item(), acc, margin, time.perf_counter() - started,
            )  # fmt: skip
    rm.model.eval()
    config.output.mkdir(parents=True, exist_ok=True)
    rm.model.save_pretrained(config.output)
    rm.tokenizer.save_pretrained(config.output)
    result.update(accuracy=acc, margin=margin, seconds=time.perf_counter() - started)
    (config.output / "reward_model_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    config = parse_config(RewardModelTrainConfig, argv, prog="train-reward-model")
    setup_logging("reward_model")
    try:
        result = train(config)
    except (PairsError, RewardModelError) as e:
        sys.stderr.write(f"train-reward-model: error: {e}\n")
        raise SystemExit(1) from None
    print(
        f"train-reward-model: wrote {config.output}; held-out accuracy "
        f"{result['start_accuracy']:.3f} -> {result['accuracy']:.3f}"
    )
