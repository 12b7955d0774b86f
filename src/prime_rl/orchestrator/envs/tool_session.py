"""The tool host's side of a v1 env's sandboxed tools (`sandboxed_tools.py` is the orchestrator's):
the host loads this module by name, `preload` before its sessions fork, and each session calls
`open_tools` once and `call_tool` per tool call.

Invariant: a session builds its own toolsets (its task type's for its task config, and the
taskset's), so a trace's tool state dies with its session; `call_tool` never raises (`ToolBox.call`).
"""

from __future__ import annotations

import json
import os

from prime_rl.orchestrator.envs.sandboxed_tools import ENV
from prime_rl.orchestrator.envs.tools import ToolBox
from prime_rl.sandbox.host import resolve

_env = None
_box: ToolBox | None = None


def preload() -> None:
    """In the host, before its sessions fork: the env loaded once (0.7 s), not per session."""
    global _env
    from prime_rl.orchestrator.envs.v1_env import load_v1_env

    env_id, args = json.loads(os.environ[ENV])
    _env = load_v1_env(env_id, args)


def open_tools(task: str, config: list) -> list[str]:
    """In the session: its own tools built, as the trace's (its task type's toolsets for its task
    config `[config type, fields]`, and the taskset's)."""
    global _box
    try:
        kind, (config_type, fields) = resolve(task), config
        own = kind.toolsets(resolve(config_type).model_validate(fields))
    except (ImportError, AttributeError):  # a type not importable by its name (defined in a function)
        own = _env.first.toolsets(_env.first.config)
    _box = ToolBox.of([*own, *_env.shared_tools], schemas=False)
    return sorted(_box.functions)


async def call_tool(name: str, arguments: str) -> list:
    """In the session: [result text, failed]."""
    assert _box is not None, "open_tools first"
    return list(await _box.call(name, arguments))
