"""Configuration of `uv run sft`: the training sections it shares with the RL trainer, and its data."""

from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from prime_rl.config import BaseConfig
from prime_rl.trainer.config import TrainingConfig


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


class SFTConfig(TrainingConfig):
    """sft: supervised fine-tuning on chat examples (loss on completion tokens only), e.g. to warm up a
    model for RL. The training sections are the trainer's (`TrainingConfig`); no RL knob applies."""

    data: SFTDataConfig = SFTDataConfig()
    """The examples."""

    batch_size: int = Field(default=32, ge=1)
    """Examples per optimizer step (over all ranks)."""

    save_dir: Path | None = None
    """Also save the final model as an HF folder here (default: <output_dir>/model)."""
