"""Configuration of the trainer (`uv run trainer`) and of SFT (`uv run sft`)."""

from pathlib import Path
from typing import Literal

from pydantic import Field

from prime_rl.config import BaseConfig, RootConfig
from prime_rl.defaults import DEFAULT_MAX_STEPS, DEFAULT_MODEL, DEFAULT_OUTPUT_DIR, DEFAULT_SEQ_LEN
from prime_rl.transport.config import TransportConfig


class ModelConfig(BaseConfig):
    """The model being trained."""

    name: str = DEFAULT_MODEL
    """HF model name or local folder to load with transformers."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype (float32 gives exact logprob parity with vLLM in float32)."""

    activation_checkpointing: bool = False
    """Recompute activations in backward to save memory."""


class OptimizerConfig(BaseConfig):
    """AdamW settings."""

    lr: float = Field(default=1e-4, gt=0)
    """Peak learning rate."""

    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay."""

    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW beta1 and beta2."""

    max_norm: float = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value."""


class SchedulerConfig(BaseConfig):
    """Learning-rate schedule."""

    type: Literal["constant", "linear", "cosine"] = "constant"
    """Shape of the decay after warmup."""

    warmup_steps: int = Field(default=0, ge=0)
    """Steps of linear warmup from 0 to the peak learning rate."""

    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate as a fraction of the peak (linear and cosine)."""


class CheckpointConfig(BaseConfig):
    """Trainer checkpoints (model, optimizer, scheduler, step, RNG) for resuming."""

    interval: int | None = Field(default=None, ge=1)
    """Save every this many steps; unset disables checkpoints."""

    keep: int = Field(default=2, ge=1)
    """Keep only the last this many checkpoints."""

    resume_step: int | None = None
    """Resume from this step; -1 means the latest checkpoint; unset starts fresh."""


class TrainerConfig(RootConfig):
    """Trainer: trains the policy on the orchestrator's micro-batches and publishes its weights."""

    model: ModelConfig = ModelConfig()
    """The model and how it is held in memory."""

    output_dir: Path = DEFAULT_OUTPUT_DIR
    """Run folder: checkpoints, published weights, metrics."""

    max_steps: int = Field(default=DEFAULT_MAX_STEPS, ge=1)
    """Number of optimizer steps."""

    seq_len: int = Field(default=DEFAULT_SEQ_LEN, ge=8)
    """Tokens per packed micro-batch; longer ones are an error."""

    seed: int = 0
    """Seed for anything random in the trainer."""

    optim: OptimizerConfig = OptimizerConfig()
    """Optimizer."""

    scheduler: SchedulerConfig = SchedulerConfig()
    """Learning-rate schedule."""

    ckpt: CheckpointConfig = CheckpointConfig()
    """Checkpoints."""

    transport: TransportConfig = TransportConfig()
    """Where micro-batches come from."""
