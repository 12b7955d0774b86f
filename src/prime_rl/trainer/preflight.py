"""The trainer's preflight: checks of what its config names that validation cannot see (custom loss
and advantage functions, the servers a collective broadcast needs), run when it starts, before any
real work; `rl` runs them too (`launcher/preflight.py`).

Invariant: every check is cheap, at most importing the user's module: no model, no torch
distributed, nothing of the orchestrator. Every problem found is one sentence naming the config key
and its value, and all of them together are one `ConfigError` (exit 2, no traceback).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prime_rl.config import raise_problems
from prime_rl.config.plugins import plugin_problem

if TYPE_CHECKING:
    from prime_rl.trainer.config import TrainerConfig


def trainer_problems(config: TrainerConfig, prefix: str = "") -> list[str]:
    """Every problem of `config`; `prefix` is where it sits in a larger config ('trainer.' in rl's)."""
    problems = [
        plugin_problem(f"{prefix}loss", config.loss),
        plugin_problem(f"{prefix}advantage", config.advantage),
    ]
    if config.weight_broadcast.type == "collective" and not config.weight_broadcast.servers and not prefix:
        # (Under rl the servers are filled in from the deployment.)
        problems.append(
            "'weight_broadcast.type' = 'collective' needs 'weight_broadcast.servers', the inference servers' "
            'URLs (e.g. ["http://127.0.0.1:8000"])'
        )
    return [p for p in problems if p]


def check_trainer(config: TrainerConfig) -> None:
    raise_problems(trainer_problems(config))
