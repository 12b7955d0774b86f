"""`uv run inference @ infer.toml`: vLLM's OpenAI-compatible server for the policy.

vLLM runs as this process's child (`supervise.py`): Ctrl-C or SIGTERM stops it within seconds, with
one line and no traceback, whether it is starting or serving.
"""

import sys
from pathlib import Path

from prime_rl.config import parse_config, raise_problems
from prime_rl.engine.server import UnsafeFolder, server_command, server_env
from prime_rl.inference.config import InferenceConfig
from prime_rl.inference.member import Member
from prime_rl.inference.preflight import bind_problems, inference_problems
from prime_rl.inference.supervise import run_server
from prime_rl.runtime import secret
from prime_rl.runtime.logging_setup import setup_logging
from prime_rl.runtime.shutdown import Stopped, exit_stopped, stopping, take_signals

LEAVE_MARGIN_S = 45.0
"""Beyond `pool.drain_s`: the orchestrator's answer (30 s) and vLLM's stop."""


def check_inference(config: InferenceConfig) -> None:
    problems = inference_problems(config)
    try:  # by hand without a secret: the run's, from its output folder (vLLM inherits it)
        secret.ensure(config.output_dir)
    except secret.SecretError as e:
        problems.append(str(e))
    raise_problems(problems + bind_problems(config))


def main(argv: list[str] | None = None) -> None:
    setup_logging("inference")
    take_signals()
    member = None
    try:
        config = parse_config(
            InferenceConfig,
            argv,
            prog="inference",
            check=check_inference,
        )
        env = server_env(config)  # creates <output_dir>/inference
        if config.pool.join:
            member = Member(config)
            # Leaving waits for the drain: the stop's deadline is past it.
            take_signals(grace_s=config.pool.drain_s + LEAVE_MARGIN_S)
        code = run_server(server_command(config), env, Path(config.output_dir) / "inference", member)
    except Stopped:
        exit_stopped()
    except UnsafeFolder as e:
        sys.stderr.write(f"inference: error: {e}\n")
        raise SystemExit(2) from None
    if member is not None and member.left:  # drained and let go by the run: a clean stop
        raise SystemExit(0)
    if stopping() is not None:
        exit_stopped()
    raise SystemExit(code)
