"""Defaults shared by several configs, kept in one place so that the processes agree on them."""

from pathlib import Path

DEFAULT_MODEL = "models/tiny"
"""The project's own tiny model (`uv run make-tiny-model` writes it here)."""

DEFAULT_OUTPUT_DIR = Path("outputs")
"""Where a run writes checkpoints, weights, rollouts, metrics and logs."""

DEFAULT_MAX_STEPS = 20
DEFAULT_SEQ_LEN = 512
DEFAULT_MAX_ASYNC_LEVEL = 1
