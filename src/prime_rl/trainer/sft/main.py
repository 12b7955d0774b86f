"""`uv run sft @ sft.toml`: supervised fine-tuning with the trainer's machinery.

The same step as RL (`trainer/step.py`: model loading, packing, global-token normalization,
FSDP, the optimizer), with the SFT objective (`sft/objective.py`: cross-entropy on completion
tokens), and the same checkpoints and publishing. Examples are tokenized with the model's chat template exactly
as inference will render them: the completion is what the template adds after the prompt's
generation prefix, so the model learns to end its turn with the template's end-of-turn token.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from prime_rl.config import parse_config
from prime_rl.runtime.logging_setup import setup_logging
from prime_rl.trainer.loop import Steps, metrics_log, resume, train_loop
from prime_rl.trainer.memory import keep_freed_memory
from prime_rl.trainer.parallel.dist import World, init_world, init_world_or_exit, run_rank
from prime_rl.trainer.run import NEEDS_USER, USER_ERRORS
from prime_rl.trainer.sft.config import SFTConfig, SFTDataConfig
from prime_rl.trainer.sft.objective import SFT
from prime_rl.trainer.weights.checkpoint import Checkpointer, checkpoint_root
from prime_rl.trainer.weights.publish import Publisher
from prime_rl.transport.messages import MicroBatch, TrainingSample
from prime_rl.transport.packing import pack

log = logging.getLogger("prime_rl.sft")


class SFTDataError(ValueError):
    """The SFT data cannot be read or has the wrong shape; the message names the file and line."""


class Example(NamedTuple):
    prompt: list[dict]
    completion: list[dict]
    where: str
    """Its source, for error messages: `file:line` or `env row i`."""
    tools: list[dict] | None = None
    """Tool definitions (OpenAI format) the chat template renders into the prompt, as inference would."""


def read_examples(config: SFTDataConfig) -> list[Example]:
    """Every example: prompt and completion messages, source, tools."""
    if (config.path is None) == (config.env_id is None):
        raise SFTDataError("set exactly one of data.path and data.env_id")
    out = []
    if config.path is not None:
        if not Path(config.path).is_file():
            raise SFTDataError(f"data.path '{config.path}' not found")
        with Path(config.path).open() as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{config.path}:{i}"
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SFTDataError(f"{where}: not JSON ({e})") from None
                prompt, completion = split_row(row, where)
                tools = row.get("tools")
                if tools is not None and not isinstance(tools, list):
                    raise SFTDataError(f"{where}: 'tools' must be a list of tool definitions")
                out.append(Example(prompt, completion, where, tools))
    else:
        from prime_rl.environments import load_v1_env, prompt_messages

        for i, task in enumerate(load_v1_env(config.env_id, config.env_args).taskset):
            if config.num_examples and len(out) >= config.num_examples:
                break
            answer = getattr(task.data, "answer", None)
            if answer is None:
                raise SFTDataError(f"env '{config.env_id}': its tasks have no 'answer' field to train on")
            content = config.answer_format.replace("{answer}", str(answer))
            out.append(
                Example(
                    prompt_messages(task.data), [{"role": "assistant", "content": content}], f"env task {i}"
                )
            )
    if config.num_examples:
        out = out[: config.num_examples]
    if not out:
        raise SFTDataError("no SFT examples found")
    return out


def split_row(row: dict[str, Any], where: str) -> tuple[list[dict], list[dict]]:
    def as_messages(value, role):
        return [{"role": role, "content": value}] if isinstance(value, str) else list(value)

    if "messages" in row:
        msgs = row["messages"]
        n = len(msgs)
        while n > 0 and msgs[n - 1].get("role") == "assistant":
            n -= 1
        if n == len(msgs) or n == 0:
            raise SFTDataError(f"{where}: 'messages' must end with assistant turn(s) after a prompt")
        return msgs[:n], msgs[n:]
    if "prompt" in row and "completion" in row:
        return as_messages(row["prompt"], "user"), as_messages(row["completion"], "assistant")
    raise SFTDataError(f"{where}: expected {{'messages': [...]}} or {{'prompt': ..., 'completion': ...}}")


def tokenize(
    tokenizer, prompt: list[dict], completion: list[dict], where: str, tools: list[dict] | None = None
) -> TrainingSample:
    """Prompt ids exactly as inference sees them, then the completion as the model would produce it.

    The completion is tokenized on its own, after the rendered prompt: BPE may merge characters across
    the boundary when prompt and completion are tokenized as one text, and a model never sees those
    merged tokens when it generates after the prompt.
    """
    prompt_text = tokenizer.apply_chat_template(
        prompt, tools=tools, add_generation_prompt=True, tokenize=False
    )
    full_text = tokenizer.apply_chat_template(prompt + completion, tools=tools, tokenize=False)
    if not full_text.startswith(prompt_text):
        raise SFTDataError(
            f"{where}: the chat template renders the prompt differently with the completion appended"
        )
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(full_text[len(prompt_text) :], add_special_tokens=False)["input_ids"]
    n = len(completion_ids)
    return TrainingSample(prompt_ids, completion_ids, [1] * n, [0.0] * n, 0.0, 0.0, "sft")


def sample_stream(samples: list[TrainingSample], seed: int, start: int) -> Iterator[TrainingSample]:
    """Endless epochs, each reshuffled; `start` skips what earlier steps consumed (for resume)."""
    epoch, i = 0, 0
    while True:
        order = list(range(len(samples)))
        random.Random(f"{seed}-{epoch}").shuffle(order)
        for j in order:
            if i >= start:
                yield samples[j]
            i += 1
        epoch += 1


def run_sft(config: SFTConfig, world: World | None = None) -> Path:
    from transformers import AutoTokenizer

    world = world or init_world(config.parallel.cp, config.parallel.ep, config.dist_timeout_s)
    keep_freed_memory(world)
    output_dir = Path(config.output_dir)
    tokenizer = AutoTokenizer.from_pretrained(config.model.name)
    samples = []
    for ex in read_examples(config.data):
        s = tokenize(tokenizer, ex.prompt, ex.completion, ex.where, ex.tools)
        if len(s) > config.seq_len:
            raise SFTDataError(f"{ex.where}: {len(s)} tokens, longer than seq_len = {config.seq_len}")
        samples.append(s)
    trainer = SFT(config, world)
    position = {"samples": 0}  # where the sample stream stands: kept in the checkpoints
    checkpointer = Checkpointer(
        checkpoint_root(output_dir), world, config.ckpt.keep, trainer.model, trainer.optimizer,
        trainer.scheduler, state=lambda: dict(position),
    )  # fmt: skip
    start, state = resume(config, world, checkpointer)
    # (a checkpoint from before the position was kept: every step took batch_size samples)
    position["samples"] = state.get("samples", start * config.batch_size)
    stream = sample_stream(samples, config.data.seed, position["samples"])
    publisher = Publisher(output_dir, config.model.name, world, config.publish.keep, lora=config.lora)
    metrics = metrics_log(world, output_dir / "sft" / "metrics.jsonl", start, config.wandb)
    if world.is_main:
        log.info("sft: %d examples, %d steps of %d", len(samples), config.max_steps, config.batch_size)

    def batches(step: int) -> list[MicroBatch]:
        batch = [next(stream) for _ in range(config.batch_size)]
        position["samples"] += len(batch)
        return pack(batch, config.seq_len, world.dp, "sft", step)[world.dp_rank]  # cp ranks share them

    def line(step: int, figures: dict[str, float]) -> str:
        return f"step {step} | loss {figures['loss']:.4f} | grad_norm {figures['grad_norm']:.3f} | {figures['time/step']:.1f}s"

    train_loop(
        config, world, trainer, checkpointer, start, Steps(batches, line, logger="prime_rl.sft"), metrics
    )
    save_dir = Path(config.save_dir or output_dir / "model")
    publisher.save(trainer.model, save_dir)
    publisher.close()
    if metrics is not None:
        metrics.close()
        log.info("saved the fine-tuned model to %s", save_dir)
    return save_dir


def main(argv: list[str] | None = None) -> None:
    config = parse_config(SFTConfig, argv, prog="sft")
    world = init_world_or_exit(config.parallel.cp, "sft", config.parallel.ep, config.dist_timeout_s)
    setup_logging("sft")
    run_rank(
        world,
        "sft",
        lambda: run_sft(config, world),
        (*USER_ERRORS, SFTDataError),
        (*NEEDS_USER, SFTDataError),
    )


if __name__ == "__main__":
    main()
