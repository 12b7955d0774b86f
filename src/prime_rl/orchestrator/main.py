"""`uv run orchestrator @ orch.toml`."""

import sys

from prime_rl.config import parse_config
from prime_rl.orchestrator.config import OrchestratorConfig


def main(argv: list[str] | None = None) -> None:
    parse_config(OrchestratorConfig, argv, prog="orchestrator")
    sys.stderr.write("orchestrator: not implemented yet (the config above is valid; try --dry-run).\n")
    raise SystemExit(1)
