"""Base classes for every config model.

Invariant: every field of every config model has a one-line docstring (it becomes the field's
description and the `--help` text), unknown keys are rejected, and a config is immutable once
validated, so a value read in one place is the value used everywhere.
"""

from pydantic import BaseModel, ConfigDict
from pydantic_settings import BaseSettings, SettingsConfigDict


class BaseConfig(BaseModel):
    """A section of a config (for example `[trainer.optim]`)."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )


class RootConfig(BaseSettings):
    """The config of one process (`rl`, `orchestrator`, `trainer`, `inference`, `sft`).

    Values come only from what `prime_rl.config.cli.parse_config` hands over (defaults, then TOML
    files, then CLI flags); environment variables are deliberately not a source, so that a run is
    fully described by its files and flags (and by `--dry-run`).
    """

    model_config = SettingsConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        validate_default=True,
    )

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, *args, **kwargs):
        return (init_settings,)
