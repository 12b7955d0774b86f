"""Configuration of the trainer (`uv run trainer`) and of SFT (`uv run sft`)."""

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from prime_rl.config import BaseConfig, RootConfig
from prime_rl.defaults import DEFAULT_MAX_STEPS, DEFAULT_MODEL, DEFAULT_OUTPUT_DIR, DEFAULT_SEQ_LEN
from prime_rl.model.local import check_model_name
from prime_rl.monitor import WandbConfig
from prime_rl.transport.config import TransportConfig


class ModelConfig(BaseConfig):
    """The model being trained."""

    name: str = DEFAULT_MODEL
    """HF model name or local folder to load with transformers."""

    @field_validator("name")
    @classmethod
    def _local_folder_exists(cls, name: str) -> str:
        return check_model_name(name)

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype (float32 gives exact logprob parity with vLLM in float32)."""

    activation_checkpointing: bool = False
    """Recompute activations in backward to save memory."""

    reshard_after_forward: bool = True
    """FSDP2: free the gathered parameters after forward (less memory, one more all-gather in backward)."""


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


class LossConfig(BaseConfig):
    """The RL loss: importance ratio between trainer and sampling logprobs, with clipping and masking."""

    ratio_type: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or one per sample (geometric mean of its token ratios, GSPO-style)."""

    clip_low: float = Field(default=0.2, ge=0)
    """PPO clip: the ratio is clipped below at 1 - clip_low."""

    clip_high: float = Field(default=0.28, ge=0)
    """PPO clip: the ratio is clipped above at 1 + clip_high."""

    mask_low: float = Field(default=0.125, ge=0)
    """Tokens whose ratio is below this are masked out of the loss (trainer and sampler disagree)."""

    mask_high: float = Field(default=8.0, gt=0)
    """Tokens whose ratio is above this are masked out of the loss."""

    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of a KL penalty to the frozen starting model (0 disables it and the reference model)."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of the KL to the reference model."""

    top_entropy_fraction: float = Field(default=1.0, gt=0, le=1)
    """Train only on this fraction of loss tokens with the highest entropy (per micro-batch)."""

    custom_import_path: str | None = None
    """A custom loss 'pkg.module:fn(LossInputs, **custom_kwargs) -> LossOutputs' replacing the built-in."""

    custom_kwargs: dict[str, Any] = {}
    """Keyword arguments of the custom loss."""


class PublishConfig(BaseConfig):
    """Weights published after every step for inference to load."""

    keep: int = Field(default=3, ge=1)
    """Keep only the newest this many published steps."""


class ExportConfig(BaseConfig):
    """Per-token export of what the loss saw (opt-in)."""

    enabled: bool = False
    """Write <output_dir>/trainer/tokens/step_<N>/rank_<r>.jsonl, one line per packed sample."""


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

    loss: LossConfig = LossConfig()
    """The RL loss."""

    publish: PublishConfig = PublishConfig()
    """Weight publishing."""

    export: ExportConfig = ExportConfig()
    """Token export."""

    transport: TransportConfig = TransportConfig()
    """Where micro-batches come from."""

    max_nan_steps: int = Field(default=3, ge=1)
    """Consecutive steps with a non-finite loss (each skipped) after which training stops."""

    wandb: WandbConfig = WandbConfig()
    """W&B logging."""


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


class SFTConfig(TrainerConfig):
    """sft: supervised fine-tuning on chat examples (loss on completion tokens only), e.g. to warm up a model for RL."""

    data: SFTDataConfig = SFTDataConfig()
    """The examples."""

    batch_size: int = Field(default=32, ge=1)
    """Examples per optimizer step (over all ranks)."""

    save_dir: Path | None = None
    """Also save the final model as an HF folder here (default: <output_dir>/model)."""
