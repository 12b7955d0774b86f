"""Load a verifiers environment by id, for the orchestrator (RL) and the trainer (SFT data) alike.

Invariant: a failure to load raises `EnvError` whose message names the env and says what an env id
must be, without verifiers' own traceback-like log line.
"""

from __future__ import annotations

import logging
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
