"""How `rl` serves the policy when the config leaves it to `rl` (`deployment.inference_mode = "auto"`).

Invariant: "auto" becomes "engine" only for a run that an explicit "engine" would accept (one machine,
one policy server, full weights, no env workers, no collective broadcast), and
"server" otherwise; an explicit choice is never changed. Everything after `resolve` sees "server" or
"engine", decided once per `rl` start, so a restarted process is served as its first life was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prime_rl.launcher.config import RLConfig


def why_server(config: RLConfig) -> str | None:
    """Why "auto" serves `config` with a server (None: nothing keeps the engine out)."""
    return config.engine_obstacle() or None


def resolve(config: RLConfig) -> tuple[RLConfig, str]:
    """`config` with its inference mode decided, and the line that says which and why."""
    d = config.deployment
    if d.inference_mode != "auto":
        return config, f"rl: policy served by {_served_by(d.inference_mode)} (deployment.inference_mode)"
    why = why_server(config)
    mode = "server" if why else "engine"
    deployment = d.model_copy(update={"inference_mode": mode})
    because = f"{why}, so a server" if why else "one machine, nothing against the engine"
    line = f"rl: policy served by {_served_by(mode)} (deployment.inference_mode = auto: {because})"
    return config.model_copy(update={"deployment": deployment}), line


def _served_by(mode: str) -> str:
    return "vLLM's engine in the orchestrator's process" if mode == "engine" else "a vLLM server"
