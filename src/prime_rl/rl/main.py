"""`uv run rl @ rl.toml`: resolve one config into the three processes and run them."""

import sys

from prime_rl.config import parse_config
from prime_rl.rl.config import RLConfig


def main(argv: list[str] | None = None) -> None:
    parse_config(RLConfig, argv, prog="rl")
    sys.stderr.write("rl: the launcher is not implemented yet (the config is valid; try --dry-run).\n")
    raise SystemExit(1)
