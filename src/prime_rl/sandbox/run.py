"""Run a command in a sandbox and say how it ended.

Invariants: a run never raises for what its command does: a deadline, a limit, a crash or too much
output is a `Result` whose `reason` says which; when `run` returns (or is cancelled) no process of
the sandbox is left, and its scratch folder is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import secrets
import shutil
import signal
import tempfile
from dataclasses import dataclass
from pathlib import Path

from prime_rl.sandbox.bwrap import SANDBOX_USER, command
from prime_rl.sandbox.config import SandboxConfig

REASONS = ("ok", "error", "timeout", "cpu", "memory", "output", "killed")
"""How a run ends: its command exited 0; exited otherwise; passed the deadline; its CPU seconds;
ran out of memory; printed past `output_kb`; was killed by a signal."""

USERS = 1_000_000_000
"""How many user ids the sandboxes draw theirs from (above `SANDBOX_USER`): at random, so that
sandboxes of other processes and other runs on the machine (whose counts would start where ours do)
are other users, with process counts of their own."""


@dataclass(frozen=True)
class Result:
    reason: str
    """One of `REASONS`."""
    exit_code: int | None
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


def _limits(config: SandboxConfig):
    """The rlimits, set in the child before it becomes the sandbox (they hold for all it starts)."""
    mb = 1024 * 1024

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (config.cpu_s, config.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (config.memory_mb * mb, config.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (config.file_mb * mb, config.file_mb * mb))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))

    # The kernel counts a user's processes and threads wherever they are: root starts the sandbox as
    # a user of its own; anyone else's count already holds their own processes.
    nproc = config.processes if os.geteuid() == 0 else _tasks_of(os.getuid()) + config.processes
    return apply


def _tasks_of(uid: int) -> int:
    """The processes and threads of user `uid` (what RLIMIT_NPROC counts)."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}").st_uid == uid:
                n += len(os.listdir(f"/proc/{pid}/task"))
    return n


async def _read(stream: asyncio.StreamReader, into: bytearray, cap: int, over) -> None:
    """`stream` read to its end, its first `cap` bytes kept in `into` (kept too if the read is cut
    short by the deadline); `over()` is called once it has more."""
    while chunk := await stream.read(65536):
        if len(into) <= cap:
            into += chunk
            if len(into) > cap:
                over()


@dataclass
class Sandbox:
    """A started sandbox: its first command runs (`proc`, piped) until `stop`."""

    proc: asyncio.subprocess.Process
    scratch: Path
    uid: int | None
    first: asyncio.Future
    status: asyncio.Task

    @classmethod
    async def start(
        cls,
        argv: list[str],
        config: SandboxConfig,
        read_only: list[str] = (),
        env: dict[str, str] | None = None,
    ) -> Sandbox:
        """`argv` started in a fresh sandbox (see `bwrap.py`) within `config`'s limits, with `env`
        its only variables beyond the sandbox's own."""
        # In /tmp, not the run's private TMPDIR: a unix socket's path (the tool host's) must stay
        # under 108 bytes. mkdtemp makes it 0700; it then belongs to the sandbox's user alone.
        scratch = Path(
            tempfile.mkdtemp(prefix="prime-rl-sandbox-", dir="/tmp" if os.path.isdir("/tmp") else None)
        )
        uid = None
        if os.geteuid() == 0:
            uid = SANDBOX_USER + secrets.randbelow(USERS)
            os.chown(scratch, uid, uid)
        status_r, status_w = os.pipe()  # bubblewrap says there the pid of the sandbox's first process
        try:
            cmd = command(argv, scratch, [*read_only, *config.read_only], config.network, uid, status_w, env)
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                preexec_fn=_limits(config),
                start_new_session=True,
                pass_fds=(status_w,),
            )
        except BaseException:
            os.close(status_r)
            shutil.rmtree(scratch, ignore_errors=True)
            raise
        finally:
            os.close(status_w)
        first = asyncio.get_running_loop().create_future()
        return cls(proc, scratch, uid, first, asyncio.ensure_future(_status(status_r, first)))

    def kill(self) -> None:
        """Kill it now (`stop` still waits for the rest)."""
        _kill(self.proc)

    async def stop(self) -> None:
        """Kill everything it runs, wait until nothing of it is left, remove its scratch folder."""
        proc = self.proc
        _kill(proc)
        # The pipes read to their end (the processes are gone): asyncio's `wait` waits for them.
        for stream in (proc.stdout, proc.stderr):
            with contextlib.suppress(Exception):
                while await stream.read(65536):
                    pass
        await proc.wait()
        await _gone(self.first, self.uid)
        await self.status
        shutil.rmtree(self.scratch, ignore_errors=True)


async def run(
    argv: list[str], config: SandboxConfig, stdin: bytes = b"", read_only: list[str] = ()
) -> Result:
    """`argv` in a fresh sandbox, fed `stdin`, within `config`'s limits, to its end."""
    box = await Sandbox.start(argv, config, read_only)
    proc = box.proc
    cap, past, out, err = config.output_kb * 1024, [], bytearray(), bytearray()

    def over() -> None:  # killed at once: its pipes then end, and the reads with them
        past.append(True)
        box.kill()

    reason = "timeout"
    try:
        async with asyncio.timeout(config.timeout_s):
            proc.stdin.write(stdin)
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                await proc.stdin.drain()
            proc.stdin.close()
            await asyncio.gather(_read(proc.stdout, out, cap, over), _read(proc.stderr, err, cap, over))
            code = await proc.wait()
            reason = "output" if past else _reason(code, bytes(err))
    except TimeoutError:
        pass
    finally:
        await box.stop()
    text = (bytes(b[:cap]).decode(errors="replace") for b in (out, err))
    return Result(reason, proc.returncode, *text)


def _reason(code: int, stderr: bytes) -> str:
    """How the command ended, from bubblewrap's exit status (its command's, or 128 + its signal)."""
    if code == 0:
        return "ok"
    if code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        return "cpu"
    if b"MemoryError" in stderr or b"Cannot allocate memory" in stderr:
        return "memory"
    if code < 0 or code > 128:
        return "killed"
    return "error"


async def _status(fd: int, first: asyncio.Future) -> None:
    """bubblewrap's JSON status read to its end (it writes the exit too: a closed pipe would kill it);
    `first` gets the pid of the sandbox's first process (the init of its PID namespace), or None."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0)
    )
    try:
        while line := await reader.readline():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                if not first.done():
                    first.set_result(json.loads(line)["child-pid"])
    finally:
        transport.close()
        if not first.done():
            first.set_result(None)


async def _gone(first: asyncio.Future, uid: int | None) -> None:
    """Until no process of the sandbox is left: its first process (the init of its PID namespace,
    whose death kills every other one in it) killed and gone, and, where it ran as a user of its
    own, no process of that user left (they may still be finishing their exit)."""
    pid = await first
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    while (pid is not None and _alive(pid)) or (uid is not None and _alive_of(uid)):
        await asyncio.sleep(0.005)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not: no reaper may ever come for it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _alive_of(uid: int) -> bool:
    """Whether a process of user `uid` runs."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{pid}").st_uid == uid and _alive(int(pid)):
                return True
    return False


def _kill(proc) -> None:
    """The sandbox's processes: bubblewrap's session (its PID namespace dies with its first process)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
