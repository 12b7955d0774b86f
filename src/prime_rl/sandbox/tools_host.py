"""The orchestrator's side of a tool host (`host.py`): started once in a sandbox, a session per
rollout, each call a JSON line on the session's connection.

Invariants: a session ends killed (its process group) whatever it was doing; a call that passes its
deadline, or whose session died, is a `ToolFailed` saying which; the host's own death fails calls,
never the caller's process.
"""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import prime_rl
from prime_rl.sandbox.bwrap import python_paths
from prime_rl.sandbox.config import SandboxConfig
from prime_rl.sandbox.run import Sandbox

HOST_CPU_S = 10**9
"""The host process's own CPU limit: none to speak of (it accepts and forks)."""
HOST_PROCESSES = 4096
"""Processes of the host's user: every session is one (a step's rollouts hold theirs at once), so a
session's fork bomb stops here, at the host's sessions, never at the machine's."""
HOST_MEMORY_MB = 1 << 30
"""Nor an address-space limit: what it imports (torch maps gigabytes) would not fit. Each session
may map `memory_mb` more than the host had when it forked."""


class ToolFailed(RuntimeError):
    """A call that got no answer: `reason` is 'timeout' or 'died'."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class Session:
    host: ToolsHost
    pid: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def call(self, fn: str, kwargs: dict[str, Any], timeout_s: float) -> Any:
        """`fn` ('module:qualname') called with `kwargs` in the session; its error re-raised as
        a `ValueError` with its message (the model's to read)."""
        self.writer.write(json.dumps({"fn": fn, "kwargs": kwargs}).encode() + b"\n")
        try:
            async with asyncio.timeout(timeout_s):
                await self.writer.drain()
                line = await self.reader.readline()
        except TimeoutError:
            await self.close()
            raise ToolFailed("timeout", f"the tool {fn} ran past {timeout_s} s") from None
        if not line:
            raise ToolFailed("died", f"the tool {fn} died (a limit, or a crash)")
        answer = json.loads(line)
        if "error" in answer:
            raise ValueError(answer["error"])
        return answer["result"]

    async def close(self) -> None:
        self.writer.close()
        self.host.kill(self.pid)


class ToolsHost:
    """A sandboxed host that imported `modules` once, serving sessions."""

    def __init__(self, box: Sandbox, socket_path: str):
        self.box, self.socket_path = box, socket_path

    @classmethod
    async def start(
        cls,
        modules: list[str],
        config: SandboxConfig,
        read_only: list[str] = (),
        paths: list[str] = (),
        env: dict[str, str] | None = None,
    ) -> ToolsHost:
        """A host that imported `modules` (found also in `paths`, which it may read; 'module:function'
        entries are called), with `env` among its variables."""
        # The host runs this very prime_rl (its folder first on the path), whatever else is installed.
        paths = [str(Path(prime_rl.__file__).resolve().parents[1]), *paths]
        # The host lives as long as the run: `cpu_s` bounds each session (its forked child), not it.
        box = await Sandbox.start(
            [sys.executable, "-m", "prime_rl.sandbox.host", "host.sock", *modules],
            config.model_copy(
                update={"cpu_s": HOST_CPU_S, "memory_mb": HOST_MEMORY_MB, "processes": HOST_PROCESSES}
            ),
            [*python_paths(), *read_only, *paths],
            {
                "PYTHONPATH": ":".join(paths),
                "PRIME_RL_SESSION_CPU_S": str(config.cpu_s),
                "PRIME_RL_SESSION_MEMORY_MB": str(config.memory_mb),
                **(env or {}),
            },
        )
        line = await box.proc.stdout.readline()
        if line.strip() != b"ready":
            err = await box.proc.stderr.read(4000)
            await box.stop()
            raise RuntimeError(f"the tool host did not start: {err.decode(errors='replace')[-2000:]}")
        return cls(box, str(box.scratch / "host.sock"))

    async def session(self) -> Session:
        reader, writer = await asyncio.open_unix_connection(self.socket_path)
        hello = json.loads(await reader.readline())
        return Session(self, hello["pid"], reader, writer)

    def kill(self, pid: int) -> None:
        self.box.proc.stdin.write(json.dumps({"kill": pid}).encode() + b"\n")

    async def close(self) -> None:
        self.box.proc.stdin.close()
        await self.box.stop()
