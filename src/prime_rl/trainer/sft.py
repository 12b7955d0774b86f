"""`uv run sft @ sft.toml`: supervised warm-up with the trainer's machinery."""

import sys

from prime_rl.config import parse_config
from prime_rl.trainer.config import TrainerConfig


def main(argv: list[str] | None = None) -> None:
    parse_config(TrainerConfig, argv, prog="sft")
    sys.stderr.write("sft: not implemented yet (the config is valid; try --dry-run).\n")
    raise SystemExit(1)
