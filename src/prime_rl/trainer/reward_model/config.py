"""Configuration of `uv run train-reward-model`."""

from pathlib import Path

from pydantic import Field, model_validator

from prime_rl.config import BaseConfig, RootConfig


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


class RewardModelTrainConfig(RootConfig):
    """train-reward-model: Bradley-Terry training of a one-output sequence classifier."""

    base_model: str
    """Causal LM folder to start from (its tokenizer and body; the head is new), e.g. the SFT policy."""

    output: Path
    """Folder to save the reward model to (weights, config, tokenizer)."""

    data: PairsConfig
    """The preference pairs."""

    max_steps: int = Field(default=1000, ge=1)
    """Optimizer steps."""

    batch_size: int = Field(default=64, ge=1)
    """Pairs per step."""

    lr: float = Field(default=1e-3, gt=0)
    """AdamW learning rate (constant after a 5% warm-up)."""

    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""

    max_length: int = Field(default=512, ge=8)
    """Tokens kept per conversation (from its end)."""

    eval_interval: int = Field(default=100, ge=1)
    """Steps between held-out accuracy measurements."""

    seed: int = 0
    """Seeds the split, the pair order and the head's initialization."""

    threads: int | None = Field(default=None, ge=1)
    """torch CPU threads (default: torch's own choice)."""
