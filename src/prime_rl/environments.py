"""Load a verifiers environment by id, for the orchestrator (RL) and the trainer (SFT data) alike,
and tell which module an env id names, and whether it is a `verifiers.v1` env, without loading it.

Invariant: a failure to load raises `EnvError` whose message names the env and says what an env id
must be, without verifiers' own traceback-like log line. `env_module_name` and `exports_v1_taskset`
never import verifiers (seconds): the preflights use them.
"""

from __future__ import annotations

import logging
import sys
from typing import Any


class EnvError(ValueError):
    """An environment cannot be loaded or used; the message names it."""


def load_vf_env(env_id: str, args: dict[str, Any]):
    """`verifiers.load_environment`, with failures turned into an `EnvError` naming the env."""
    import verifiers as vf

    # verifiers logs a traceback-like error before raising; our message says it better.
    logging.getLogger("verifiers").setLevel(logging.CRITICAL)
    try:
        env = vf.load_environment(env_id, **args)
    except Exception as e:
        cause = e.__cause__ or e
        raise EnvError(
            f"env '{env_id}' could not be loaded: {type(cause).__name__}: {cause}. "
            f"It must be an installed package or importable module exposing load_environment(**args)."
        ) from None
    finally:
        logging.getLogger("verifiers").setLevel(logging.WARNING)
    return env


def env_module_name(env_id: str) -> str:
    """The module verifiers imports for an env id: dashes as underscores, any 'owner/' prefix dropped.

    The same rule as verifiers' own `env_module_name`, which is not imported here: importing it loads
    the whole of verifiers (seconds), and the preflights must stay cheap.
    """
    return env_id.replace("-", "_").split("/")[-1]


def exports_v1_taskset(module) -> bool:
    """Whether a module exports a `verifiers.v1` Taskset or Env subclass in `__all__`. Cheap: a v1
    env module has imported verifiers.v1 already; without it, the answer is no."""
    v1 = sys.modules.get("verifiers.v1")
    if v1 is None:
        return False
    exported = [getattr(module, n, None) for n in getattr(module, "__all__", [])]
    return any(isinstance(o, type) and issubclass(o, v1.Taskset | v1.Env) for o in exported)
