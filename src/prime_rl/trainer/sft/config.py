"""Configuration of `uv run sft`: the trainer's sections that SFT uses, and its data."""

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator

from prime_rl.config import BaseConfig, RootConfig
from prime_rl.defaults import DEFAULT_MAX_STEPS, DEFAULT_OUTPUT_DIR, DEFAULT_SEQ_LEN
from prime_rl.monitor import WandbConfig
from prime_rl.trainer.config import (
    CheckpointConfig,
    LoRAConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    PublishConfig,
    SchedulerConfig,
    TrainerConfig,
    check_cp_fits,
)


class SFTDataConfig(BaseConfig):
    """Where SFT examples come from: a local JSONL, or an env's dataset (prompt + answer)."""

    path: Path | None = None
    """JSONL with {"messages": [...]} (trained on the assistant turns at the end) or {"prompt", "completion"};
    a row may add "tools": [...] (OpenAI tool definitions, rendered by the chat template as in inference)."""

    env_id: str | None = None
    """Instead of a file: a verifiers env whose dataset rows give the prompt and `answer` the completion."""

    env_args: dict[str, Any] = {}
    """Keyword arguments of the env's load_environment."""

    answer_format: str = "{answer}"
    """With env_id: the completion text, where `{answer}` stands for the row's answer (e.g. "<answer>{answer}</answer>")."""

    @field_validator("answer_format")
    @classmethod
    def _has_answer(cls, v: str) -> str:
        if "{answer}" not in v:
            raise ValueError("must contain {answer}, where the row's answer goes")
        return v

    num_examples: int | None = Field(default=None, ge=1)
    """Use only the first this many examples."""

    seed: int = 0
    """Shuffle seed (each epoch is reshuffled)."""


class SFTConfig(RootConfig):
    """sft: supervised fine-tuning on chat examples (loss on completion tokens only), e.g. to warm up a model for RL."""

    model: ModelConfig = ModelConfig()
    """The model and how it is held in memory."""

    lora: LoRAConfig | None = None
    """Train LoRA adapters instead of the full weights. Unset: full fine-tuning."""

    output_dir: Path = DEFAULT_OUTPUT_DIR
    """Run folder: checkpoints, published weights, metrics."""

    max_steps: int = Field(default=DEFAULT_MAX_STEPS, ge=1)
    """Optimizer steps."""

    seq_len: int = Field(default=DEFAULT_SEQ_LEN, ge=8)
    """Tokens per packed micro-batch; an example longer than this is an error."""

    seed: int = 0
    """Seed of the model's fresh parts (LoRA adapters)."""

    parallel: ParallelConfig = ParallelConfig()
    """Context parallelism (data parallelism is torchrun's ranks / cp)."""

    optim: OptimizerConfig = OptimizerConfig()
    """Optimizer."""

    scheduler: SchedulerConfig = SchedulerConfig()
    """Learning-rate schedule."""

    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpoints."""

    publish: PublishConfig = PublishConfig()
    """Weights published under output_dir/weights as training goes."""

    wandb: WandbConfig = WandbConfig()
    """W&B logging."""

    data: SFTDataConfig = SFTDataConfig()
    """The examples."""

    batch_size: int = Field(default=32, ge=1)
    """Examples per optimizer step (over all ranks)."""

    save_dir: Path | None = None
    """Also save the final model as an HF folder here (default: <output_dir>/model)."""

    @model_validator(mode="after")
    def _cp_fits_the_micro_batch(self):
        check_cp_fits(self.seq_len, self.parallel.cp)
        return self

    def trainer_config(self) -> TrainerConfig:
        """The trainer's config of this run: the sections SFT shares, the RL knobs at their defaults
        (the SFT step brings its own loss, and no estimator, critic or reward runs)."""
        shared = {
            k: getattr(self, k)
            for k in (
                "model",
                "lora",
                "output_dir",
                "max_steps",
                "seq_len",
                "seed",
                "parallel",
                "optim",
                "scheduler",
                "ckpt",
                "publish",
                "wandb",
            )
        }
        return TrainerConfig(**shared)
