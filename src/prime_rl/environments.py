"""Load a verifiers v1 environment by id, for the orchestrator (RL) and the trainer (SFT data)
alike, and tell which module an env id names, and whether it is a v1 env, without loading it.

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


def load_v1_env(env_id: str, args: dict[str, Any]):
    """verifiers v1's env for `env_id` (its taskset's own `Env` class, else the single-seat one)
    with `args` as its taskset config; failures turned into an `EnvError` naming the env."""
    import verifiers.v1 as vf

    logging.getLogger("verifiers").setLevel(logging.CRITICAL)  # our message says it better
    try:
        return vf.load_environment(vf.resolve_env_config({"taskset": {"id": env_id, **args}}))
    except Exception as e:
        cause = e.__cause__ or e
        raise EnvError(
            f"env '{env_id}' could not be loaded: {type(cause).__name__}: {cause}. It must be an "
            "installed package or importable module exporting a verifiers.v1 Taskset in __all__."
        ) from None
    finally:
        logging.getLogger("verifiers").setLevel(logging.WARNING)


def prompt_messages(data) -> list[dict]:
    """A v1 task's opening messages (its system prompt, then its prompt) as chat dicts."""
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    elif data.prompt:
        messages += [
            m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in data.prompt
        ]
    return messages


def env_module_name(env_id: str) -> str:
    """The module verifiers imports for an env id: any 'owner/' prefix and '@version' dropped, dashes
    as underscores, lowercase (verifiers v1's rule, which is not imported here: importing verifiers
    takes seconds, and the preflights must stay cheap). verifiers first looks for it among its own
    tasksets (`verifiers.v1.tasksets.<module>`)."""
    return env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()


def exports_v1_taskset(module) -> bool:
    """Whether a module exports a `verifiers.v1` Taskset or Env subclass in `__all__`. Cheap: a v1
    env module has imported verifiers.v1 already; without it, the answer is no."""
    v1 = sys.modules.get("verifiers.v1")
    if v1 is None:
        return False
    exported = [getattr(module, n, None) for n in getattr(module, "__all__", [])]
    return any(isinstance(o, type) and issubclass(o, v1.Taskset | v1.Env) for o in exported)
