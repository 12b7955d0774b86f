"""`uv run trainer @ trainer.toml` (under torchrun for several ranks)."""

import sys

from prime_rl.config import parse_config
from prime_rl.trainer.config import TrainerConfig


def main(argv: list[str] | None = None) -> None:
    parse_config(TrainerConfig, argv, prog="trainer")
    sys.stderr.write("trainer: not implemented yet (the config is valid; try --dry-run).\n")
    raise SystemExit(1)
