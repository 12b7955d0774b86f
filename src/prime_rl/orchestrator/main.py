"""`uv run orchestrator @ orchestrator.toml` (e.g. configs/reverse_text/orchestrator.toml)."""

import asyncio
import os
import sys

from prime_rl.auth import tenant
from prime_rl.config import parse_config
from prime_rl.engine.local import LocalEngine
from prime_rl.environments import EnvError
from prime_rl.orchestrator.advantages import AdvantageError
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs.local import LocalEnvs
from prime_rl.orchestrator.loop.failures import RolloutsFailing
from prime_rl.orchestrator.loop.orchestrator import Orchestrator
from prime_rl.orchestrator.loop.progress import RunDirError
from prime_rl.orchestrator.loop.samples import RoutesMissing
from prime_rl.orchestrator.loop.servers import InferenceUnavailable
from prime_rl.orchestrator.loop.weights import AdapterRefused, WeightSyncError
from prime_rl.orchestrator.loop.weights_dir import SecretRefused, WeightsDirMismatch
from prime_rl.orchestrator.loop.workers import WorkerPool, WorkersFailing
from prime_rl.orchestrator.preflight import check_orchestrator
from prime_rl.runtime import activity, secret
from prime_rl.runtime.disk import DiskFull
from prime_rl.runtime.logging_setup import setup_logging
from prime_rl.runtime.secret import SecretError
from prime_rl.runtime.shutdown import Stopped, exit_stopped, stopping, take_signals
from prime_rl.transport.base import TransportError
from prime_rl.transport.contract import ContractError

# Failures whose message says all the user needs: one line, no traceback. Exit status 2 for those
# that need the user (a restart would fail the same way: `rl` never retries them), 1 for the rest
# (failing rollouts whose most common reason is a server's are `retryable`).
NEEDS_USER = (
    ContractError,
    EnvError,
    AdvantageError,
    RunDirError,
    RolloutsFailing,
    DiskFull,
    AdapterRefused,
    WeightsDirMismatch,
    SecretRefused,
    SecretError,
    RoutesMissing,
)
USER_ERRORS = (*NEEDS_USER, InferenceUnavailable, TransportError, WeightSyncError, WorkersFailing)


def make_orchestrator(config: OrchestratorConfig) -> Orchestrator:
    """The loop, with the env side in this process or in `env_workers` worker processes, and with
    `engine`, vLLM's engine in this process serving the env side (not started yet: the loop does)."""
    if config.engine is not None:
        engine = LocalEngine(config.engine.model_copy(update={"output_dir": config.output_dir}))
        return Orchestrator(config, LocalEnvs(config, engine=engine), engine)
    if config.env_workers == 0:
        return Orchestrator(config, LocalEnvs(config))
    return Orchestrator(config, WorkerPool(config, tasks=LocalEnvs(config, rollouts=False)))


def main(argv: list[str] | None = None) -> None:
    # Ctrl-C or SIGTERM stops the orchestrator within seconds from here on, with one line: before
    # its loop runs through `prime_rl.runtime.shutdown`, then through the loop (`Orchestrator._take_signals`).
    setup_logging("orchestrator")
    take_signals()
    try:
        config = parse_config(OrchestratorConfig, argv, prog="orchestrator", check=check_orchestrator)
        secret.ensure(config.output_dir)  # by hand without one: the run's, from its output folder
        tenant.mine()  # a tenant key file that cannot be used: one line now, not at the first request
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        activity.start("orchestrator", "orchestrator", config.output_dir, doing="loading the envs")
        asyncio.run(make_orchestrator(config).run())
    except USER_ERRORS as e:
        if stopping() is not None:  # an error the stop caused
            exit_stopped()
        sys.stderr.write(f"orchestrator: error: {e}\n")
        needs_user = isinstance(e, NEEDS_USER) and not getattr(e, "retryable", False)
        raise SystemExit(2 if needs_user else 1) from None
    except (Stopped, KeyboardInterrupt, asyncio.CancelledError):
        exit_stopped()
