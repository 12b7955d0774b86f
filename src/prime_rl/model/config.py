"""The one model section every process shares: which model, checked before anything loads it.

Each process's `[model]` section is this, plus what that process alone needs (the trainer's dtype
and attention, the server's context length); the orchestrator's is this alone.
"""

from pydantic import field_validator

from prime_rl.config import BaseConfig
from prime_rl.config.defaults import DEFAULT_MODEL
from prime_rl.model.local import check_model_name


class ModelConfig(BaseConfig):
    """The policy: what the trainer trains, inference serves and the orchestrator tokenizes for."""

    name: str = DEFAULT_MODEL
    """HF model name or local folder (a local folder must hold a config.json); also the model name
    the server answers to, and the tokenizer."""

    @field_validator("name")
    @classmethod
    def _local_folder_exists(cls, name: str) -> str:
        return check_model_name(name)
