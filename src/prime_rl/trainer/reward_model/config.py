"""Configuration of `uv run train-reward-model`: the training sections it shares with the RL trainer and
SFT (`TrainingConfig`), and its pairs.

Invariant: a config that validates can pack every pair of its data into a micro-batch (seq_len holds
two conversations of max_length tokens), and asks for no parallelism the reward model does not
implement (expert parallelism).
"""

from pathlib import Path
from typing import ClassVar

from pydantic import Field, model_validator

from prime_rl.config import BaseConfig
from prime_rl.trainer.config import OptimizerConfig, TrainingConfig


class PairsConfig(BaseConfig):
    """Where the preference pairs come from: a JSONL file, or an env module that generates them."""

    path: Path | None = None
    """JSONL, one pair per line: {"prompt": [...messages], "chosen": [...], "rejected": [...]} (a string
    is taken as one user message for the prompt, one assistant message for a completion)."""

    env_id: str | None = None
    """Instead of a file: an env whose module has `preference_pairs(num_pairs, seed)` returning such dicts."""

    num_pairs: int = Field(default=20000, ge=2)
    """With env_id: how many pairs to generate."""

    eval_fraction: float = Field(default=0.05, gt=0, lt=1)
    """Share of the pairs held out to measure accuracy."""

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.env_id is None):
            raise ValueError("set exactly one of data.path and data.env_id")
        return self


class RewardModelTrainConfig(TrainingConfig):
    """train-reward-model: Bradley-Terry training of a scalar reward model (a causal LM's body with a
    one-output head), saved as an HF *ForSequenceClassification folder. The training sections are the
    trainer's: model, lora, parallel (data parallelism over torchrun's ranks, FSDP2, cp), optim,
    scheduler, ckpt (checkpoints and resume), wandb. `publish` does not apply: only the final model is
    written."""

    moved_keys: ClassVar[dict[str, str]] = {
        "base_model": "the causal LM to start from is 'model.name' ([model] name = ...)",
        "lr": "the learning rate is 'optim.lr' ([optim] lr = ...)",
        "weight_decay": "the weight decay is 'optim.weight_decay' ([optim] weight_decay = ...)",
    }

    data: PairsConfig
    """The preference pairs."""

    output: Path | None = None
    """Folder to save the reward model to (weights, config, tokenizer, reward_model_eval.json); default
    <output_dir>/reward_model/model. Checkpoints and metrics go under output_dir."""

    max_steps: int = Field(default=1000, ge=1)
    """Optimizer steps."""

    batch_size: int = Field(default=64, ge=1)
    """Pairs per optimizer step (over all ranks)."""

    max_length: int = Field(default=512, ge=8)
    """Tokens kept per conversation (from its end: the score is read at the last token)."""

    seq_len: int = Field(default=2048, ge=16)
    """Tokens per packed micro-batch; pairs are packed whole, so it must be at least 2 x max_length."""

    eval_interval: int = Field(default=100, ge=1)
    """Steps between held-out accuracy measurements (also measured before the first step and after
    the last)."""

    seed: int = 0
    """Seeds the held-out split, the pair order, the head's initialization and env-generated pairs."""

    optim: OptimizerConfig = OptimizerConfig(lr=1e-3)
    """AdamW (the reward model's default learning rate is 1e-3)."""

    threads: int | None = Field(default=None, ge=1)
    """torch CPU threads (default: torch's own choice)."""

    @model_validator(mode="after")
    def _a_pair_fits_a_micro_batch(self):
        if self.seq_len < 2 * self.max_length:
            raise ValueError(
                f"seq_len = {self.seq_len} must hold a whole pair, two conversations of up to max_length = "
                f"{self.max_length} tokens: set seq_len >= {2 * self.max_length} or lower max_length"
            )
        return self

    @model_validator(mode="after")
    def _no_expert_parallelism(self):
        if self.parallel.ep > 1:
            raise ValueError(
                f"parallel.ep = {self.parallel.ep}: the reward model does not split experts across ranks; "
                "set ep = 1 (FSDP still shards the experts)"
            )
        return self
