"""The orchestrator's side of a tool host (`host.py`): started once in a sandbox, a session per
rollout, each call a JSON line on the session's connection.

Invariants: a session closed while a call runs (its deadline passed, or its rollout was cancelled)
has its worker killed with all it started; a call that passes its deadline, or whose worker died, is
a `ToolFailed` saying which; the host's own death fails calls, never the caller's process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import prime_rl
from prime_rl.sandbox.bwrap import python_paths
from prime_rl.sandbox.config import SandboxConfig
from prime_rl.sandbox.run import Sandbox

HOST_CPU_S = 10**9
"""The host process's own CPU limit: none to speak of (it accepts and forks)."""
HOST_PROCESSES = 2048
"""Processes and threads of the host's user (its `processes`): a worker per session held at once
(a step's rollouts hold theirs together) and what they start. A session's fork bomb stops here, at
the host's sessions (their calls fail until it is killed at its deadline), never at the machine's."""
START_S = 300.0
"""How long a tool host may take to import its env (a cold page cache, a loaded machine)."""
OPEN_S = 60.0
"""How long a rollout waits for a session: the host may be reaping a bomb's processes."""
HOST_MEMORY_MB = 1 << 30
"""Nor an address-space limit: what it imports (torch maps gigabytes) would not fit. Each session
may map `memory_mb` more than the host had when it forked."""


FAILURES = ("timeouts", "oom", "killed", "output")
"""How a sandboxed call fails (counted per env as `sandbox/<env>/<how>`): past its deadline; out of
memory (the session's `memory_mb`); its worker died (its CPU seconds, a crash, a signal); its
result was longer than `output_kb`."""


CLOSE_S = 5.0
"""How long a worker may take to clean up after its session (remove its folder, look for processes
left behind) before it is killed instead."""


SLOW_S = 5.0
"""A sandboxed call in flight longer than this is named in this process's activity record."""
_in_flight: dict[int, tuple[str, float]] = {}
"""This process's sandboxed calls in flight: key -> (what, since)."""


def slow_call(now: float | None = None) -> str:
    """The oldest sandboxed call of this process in flight for over `SLOW_S`, in words ("" if none):
    the watchdog's way to name a sandbox that holds a step up."""
    if not _in_flight:
        return ""
    what, since = min(_in_flight.values(), key=lambda c: c[1])
    if (now or time.time()) - since < SLOW_S:
        return ""
    return f"a sandboxed tool call ({what}) running since {time.strftime('%H:%M:%S', time.localtime(since))}"


class ToolFailed(RuntimeError):
    """A call that got no answer: `reason` is one of `FAILURES`, `what` says what happened to it."""

    def __init__(self, reason: str, what: str, fn: str = "the session"):
        super().__init__(f"{fn} {what}")
        self.reason, self.what = reason, what


@dataclass
class Session:
    host: ToolsHost
    pid: int
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    busy: bool = False
    """A call is in flight: closing now kills the worker (nothing else would stop the call)."""

    async def call(self, fn: str, kwargs: dict[str, Any], timeout_s: float, what: str = "") -> Any:
        """`fn` ('module:qualname') called with `kwargs` in the session; its error re-raised as
        a `ValueError` with its message (the model's to read). `what` names it while in flight.
        It waits for one of the host's call slots first (its deadline runs from then)."""
        async with self.host.slots:
            return await self._call(fn, kwargs, timeout_s, what)

    async def _call(self, fn: str, kwargs: dict[str, Any], timeout_s: float, what: str) -> Any:
        self.busy = True
        self.writer.write(json.dumps({"fn": fn, "kwargs": kwargs}).encode() + b"\n")
        key = id(self)
        _in_flight[key] = (what or fn, time.time())
        try:
            async with asyncio.timeout(timeout_s):
                await self.writer.drain()
                line = await self.reader.readline()
        except TimeoutError:
            await self.close()
            raise ToolFailed("timeouts", f"ran past {timeout_s} s", fn) from None
        except ConnectionError:
            line = b""
        except ValueError:  # a line past the reader's limit: the rest of it is still to come
            self.writer.close()
            self.host.kill(self.pid)
            raise ToolFailed("output", f"gave a result over {self.host.output_kb} KB", fn) from None
        except asyncio.CancelledError:  # its rollout was cancelled: nobody would stop the call
            self.writer.close()
            self.host.kill(self.pid)
            raise
        finally:
            _in_flight.pop(key, None)
        self.busy = False
        if not line:
            raise ToolFailed("killed", "was killed (its CPU seconds, or a crash)", fn)
        answer = json.loads(line)
        if answer.get("error", "").startswith("MemoryError"):  # what it holds may outlive the call
            self.busy = True
            await self.close()
            raise ToolFailed("oom", f"ran out of memory ({answer['error']})", fn)
        if "error" in answer:
            raise ValueError(answer["error"])
        return answer["result"]

    async def close(self) -> None:
        """The session over: its worker cleans up and is ready for another when this returns (a
        worker that runs a call, or takes longer than `CLOSE_S` to clean up, is killed)."""
        if not self.busy:
            with contextlib.suppress(ConnectionError, TimeoutError):
                self.writer.write_eof()
                async with asyncio.timeout(CLOSE_S):
                    await self.reader.read()
                self.writer.close()
                return
        self.writer.close()
        self.host.kill(self.pid)


class ToolsHost:
    """A sandboxed host that imported `modules` once, serving sessions."""

    def __init__(self, box: Sandbox, socket_path: str, parallel_calls: int, output_kb: int):
        self.box, self.socket_path, self.output_kb = box, socket_path, output_kb
        self.slots = asyncio.Semaphore(parallel_calls)

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
        # The host runs this very prime_rl (its folder first on the path), and imports what this
        # process would (its path: read-only in the sandbox).
        here = [p for p in sys.path if p and Path(p).is_dir()]
        paths = list(dict.fromkeys([str(Path(prime_rl.__file__).resolve().parents[1]), *paths, *here]))
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
                "PRIME_RL_SESSIONS_PER_WORKER": str(config.sessions_per_worker),
                **(env or {}),
            },
        )
        try:
            async with asyncio.timeout(START_S):
                line = await box.proc.stdout.readline()
        except TimeoutError:
            await box.stop()
            raise RuntimeError(f"its tool host did not start in the sandbox in {START_S:.0f} s") from None
        if line.strip() != b"ready":
            err = (await box.proc.stderr.read(100_000)).decode(errors="replace").strip()
            await box.stop()
            last = err.splitlines()[-1] if err else f"exit status {box.proc.returncode}"
            raise RuntimeError(f"its tool host did not start in the sandbox: {last}")
        return cls(box, str(box.scratch / "host.sock"), config.parallel_calls, config.output_kb)

    async def session(self, timeout_s: float) -> Session:
        """A session on a worker of its own, within `timeout_s` (the host may be starting one)."""
        writer = None
        try:
            async with asyncio.timeout(timeout_s):
                # A result is one JSON line: one longer than `output_kb` fails its call.
                limit = self.output_kb * 1024
                reader, writer = await asyncio.open_unix_connection(self.socket_path, limit=limit)
                hello = await reader.readline()
        except TimeoutError:
            if writer is not None:
                writer.close()
            raise ToolFailed("timeouts", f"got no session from the tool host in {timeout_s} s") from None
        if not hello:
            writer.close()
            raise ToolFailed("killed", "got no process from the tool host (its process limit)")
        return Session(self, json.loads(hello)["pid"], reader, writer)

    @property
    def gone(self) -> bool:
        """Whether the host has exited (nothing kills it but `close`, or the machine)."""
        return self.box.proc.returncode is not None

    def kill(self, pid: int) -> None:
        if self.box.proc.stdin.is_closing():
            return
        self.box.proc.stdin.write(json.dumps({"kill": pid}).encode() + b"\n")

    async def close(self) -> None:
        self.box.proc.stdin.close()
        await self.box.stop()
