"""`uv run rl @ rl.toml`: resolve one config into the three processes and run them together."""

from prime_rl.config import parse_config
from prime_rl.preflight import check_rl
from prime_rl.rl.config import RLConfig


def main(argv: list[str] | None = None) -> None:
    # Every check that needs no process runs here, so a mistake costs seconds, not a vLLM start-up.
    config = parse_config(RLConfig, argv, prog="rl", check=check_rl)
    from prime_rl.rl.launcher import launch

    raise SystemExit(launch(config))
