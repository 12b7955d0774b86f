"""`uv run rl @ rl.toml`: resolve one config into the three processes and run them together."""

from prime_rl.config import parse_config
from prime_rl.rl.config import RLConfig


def main(argv: list[str] | None = None) -> None:
    config = parse_config(RLConfig, argv, prog="rl")
    from prime_rl.rl.launcher import launch

    raise SystemExit(launch(config))
