"""A v1 env's tools run in its sandboxed tool host (`sandbox/tools_host.py`), one session per trace.

Both sides live here: `open_tools` and `call_tool` run inside the host's session (the env loaded
there, its toolsets built per session, so a trace's tool state dies with it); `SandboxedTools` is
what a seat holds in the orchestrator: the tools' schemas (built here, never called here) and the
session that calls them.

Invariant: as `ToolBox.call`, a call never raises: a tool that fails, hangs past the deadline or
dies (a limit) is an "Error: ..." result for the model, marked failed.
"""

from __future__ import annotations

import importlib
import json
import os
from collections import Counter

from prime_rl.orchestrator.envs.tools import ToolBox
from prime_rl.sandbox.tools_host import OPEN_S, Session, ToolFailed

HERE = __name__
ENV = "PRIME_RL_TOOLS_ENV"
"""The host's environment variable naming its env: `[env id, taskset args]` as JSON."""
_env = None
_box: ToolBox | None = None


def preload() -> None:
    """In the host, before its sessions fork: the env loaded once (0.7 s), not per session."""
    global _env
    from prime_rl.orchestrator.envs.v1_env import load_v1_env

    env_id, args = json.loads(os.environ[ENV])
    _env = load_v1_env(env_id, args)


def _named(name: str):
    module, _, qualname = name.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def open_tools(task: str, config: list) -> list[str]:
    """In the session: its own tools built, as the trace's (its task type's toolsets for its task
    config `[config type, fields]`, and the taskset's)."""
    global _box
    try:
        kind, (config_type, fields) = _named(task), config
        own = kind.toolsets(_named(config_type).model_validate(fields))
    except (ImportError, AttributeError):  # a type not importable by its name (defined in a function)
        own = _env.first.toolsets(_env.first.config)
    _box = ToolBox.of([*own, *_env.shared_tools], schemas=False)
    return sorted(_box.functions)


async def call_tool(name: str, arguments: str) -> list:
    """In the session: [result text, failed]."""
    assert _box is not None, "open_tools first"
    return list(await _box.call(name, arguments))


class SandboxedTools:
    """A trace's tools: their schemas from `local`, their calls in `session`."""

    def __init__(self, local: ToolBox, session: Session, timeout_s: float, env_id: str):
        self.tools, self.functions = local.tools, local.functions
        self.local, self.session, self.timeout_s, self.env_id = local, session, timeout_s, env_id
        self.failures: Counter[str] = Counter()
        """Its calls that failed in the sandbox, by `ToolFailed.reason`."""

    @classmethod
    async def open(cls, local: ToolBox, task, host, env_id: str, timeout_s: float) -> SandboxedTools:
        """`task`'s tools (`local`: as built here) opened in a session of `host`."""
        session = await host.session(OPEN_S)
        config = [_name(type(task.config)), task.config.model_dump(mode="json")]
        await session.call(f"{HERE}:open_tools", {"task": _name(type(task)), "config": config}, timeout_s)
        return cls(local, session, timeout_s, env_id)

    def wire(self) -> list[dict] | None:
        return self.local.wire()

    async def call(self, name: str, arguments: str) -> tuple[str, bool]:
        try:
            text, failed = await self.session.call(
                f"{HERE}:call_tool", {"name": name, "arguments": arguments}, self.timeout_s,
                f"env '{self.env_id}', tool {name}",
            )  # fmt: skip
        except ToolFailed as e:
            self.failures[e.reason] += 1
            return f"Error: the tool {name} {e.what}", True
        except ValueError as e:
            return f"Error: {e}", True
        return text, failed

    async def close(self) -> None:
        await self.session.close()
