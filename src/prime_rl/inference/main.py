"""`uv run inference @ infer.toml`: vLLM's OpenAI-compatible server for the policy."""

import os

from prime_rl.config import parse_config
from prime_rl.inference.config import InferenceConfig
from prime_rl.inference.server import server_command, server_env


def main(argv: list[str] | None = None) -> None:
    config = parse_config(InferenceConfig, argv, prog="inference")
    cmd = server_command(config)
    # Replace this process, so that signals (Ctrl-C, the rl launcher's SIGTERM) reach vLLM directly.
    os.execve(cmd[0], cmd, server_env(config))
