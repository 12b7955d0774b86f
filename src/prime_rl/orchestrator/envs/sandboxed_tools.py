"""A v1 env's tools run in its sandboxed tool host (`sandbox/tools_host.py`), one session per trace.

This is the orchestrator's side: `SandboxedTools` is what a seat holds, the tools' schemas (built
here, never called here) and the session that calls them. The host's side, run inside its
sessions, is `tool_session.py`, which the host loads by name (`HOST`).

Invariant: as `ToolBox.call`, a call never raises: a tool that fails, hangs past the deadline or
dies (a limit) is an "Error: ..." result for the model, marked failed.
"""

from __future__ import annotations

from collections import Counter

from prime_rl.orchestrator.envs.tools import ToolBox
from prime_rl.sandbox.tools_host import OPEN_S, Session, ToolFailed

HOST = "prime_rl.orchestrator.envs.tool_session"
"""The module the tool host loads by name and calls into (`tool_session.py`): the orchestrator
never imports it, it only names it to the host."""
ENV = "PRIME_RL_TOOLS_ENV"
"""The host's environment variable naming its env: `[env id, taskset args]` as JSON."""


def _name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


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
        await session.call(f"{HOST}:open_tools", {"task": _name(type(task)), "config": config}, timeout_s)
        return cls(local, session, timeout_s, env_id)

    def wire(self) -> list[dict] | None:
        return self.local.wire()

    async def call(self, name: str, arguments: str) -> tuple[str, bool]:
        try:
            text, failed = await self.session.call(
                f"{HOST}:call_tool", {"name": name, "arguments": arguments}, self.timeout_s,
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
