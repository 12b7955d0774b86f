"""A tool host: one sandboxed process that imports what the tools need once, then serves sessions
(a rollout's tool calls) in warm worker processes forked from it.

    python -m prime_rl.sandbox.host <socket path> <module or module:function> ...

Runs inside the sandbox (`tools_host.py` starts it there). It listens on a unix socket; each
connection is a session, handed to an idle worker (one is forked when none is idle: the imports are
paid once, in the host). A worker serves one session at a time: it first says its pid, then answers
JSON lines `{"fn": "module:qualname", "kwargs": {...}}` with `{"result": ...}` or `{"error": "..."}`
until the connection closes. Forking a worker costs ~5 ms of CPU for an env that imports verifiers,
so a worker serves up to `PRIME_RL_SESSIONS_PER_WORKER` sessions in turn before it is replaced.

On its standard input the host takes `{"kill": <pid>}` (a worker past its call's deadline: its
process group killed); at the input's end it kills all and exits.

Invariants: a call's failure is an answer, never the host's crash; a session never sees a process
another session started (a worker that has any process left at a session's end is replaced, and
the host, a subreaper, kills every process that is not a worker); a session starts in an empty
scratch folder of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import importlib
import inspect
import json
import os
import resource
import selectors
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass

from prime_rl.runtime.imports import heavy_imports

PR_SET_CHILD_SUBREAPER = 36


def resolve(spec: str):
    """The object a "module:qualname" names (how a session names the function it calls)."""
    module, _, qualname = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _subreaper() -> None:
    """Orphans below this process come to it (not to the sandbox's init), so none is missed."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _children() -> list[int]:
    pid = os.getpid()
    with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]
    return []


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class Limits:
    """A session's CPU seconds and the memory it may map beyond the host's; the sessions a worker
    serves. (Processes are the host's to bound, for all sessions together: the kernel counts a
    user's, and every session is the same user.)"""

    cpu_s: int
    memory_mb: int
    sessions: int

    @classmethod
    def from_env(cls) -> Limits:
        get = os.environ.get
        return cls(
            int(get("PRIME_RL_SESSION_CPU_S", "10")),
            int(get("PRIME_RL_SESSION_MEMORY_MB", "1024")),
            int(get("PRIME_RL_SESSIONS_PER_WORKER", "64")),
        )


class Worker:
    """In the forked worker: sessions served in turn, each handed over on `control`."""

    def __init__(self, control: socket.socket, home: str, limits: Limits):
        self.control, self.home, self.limits = control, home, limits
        # Not the host's reaper: it would take a tool's child from under `subprocess` (whose exit
        # status then reads 0).
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setpgid(0, 0)
        _subreaper()
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * resource.getpagesize()
        limit = size + limits.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        quiet = os.open(os.devnull, os.O_WRONLY)  # what a tool prints goes nowhere: nobody reads it
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        self.loop = asyncio.new_event_loop()  # an async tool's, kept across calls

    def serve(self) -> None:
        sessions = self.limits.sessions
        for n in range(sessions):
            _, fds, _, _ = socket.recv_fds(self.control, 1, 1)
            if not fds:  # the host is gone
                return
            folder = os.path.join(self.home, f"session-{os.getpid()}-{n}")
            os.mkdir(folder, 0o700)
            os.chdir(folder)
            # Its temporary files too (the sandbox's /tmp is not the session's to write).
            os.environ["TMPDIR"] = folder
            tempfile.tempdir = None
            # The session's CPU seconds, on top of what this worker used before it.
            hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
            resource.setrlimit(resource.RLIMIT_CPU, (int(_cpu_s()) + self.limits.cpu_s, hard))
            with socket.socket(fileno=fds[0]) as conn:
                self.session(conn)
                os.chdir(self.home)
                shutil.rmtree(folder, ignore_errors=True)
                # A process or thread it left running could reach the next session: replaced instead.
                if _children() or len(os.listdir("/proc/self/task")) > 1 or n + 1 == sessions:
                    return
                # Ready before the caller hears the session's end (its connection closing here).
                self.control.send(b"d")

    def session(self, conn: socket.socket) -> None:
        stream = conn.makefile("rwb", buffering=0)
        stream.write(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        for line in stream:
            try:
                call = json.loads(line)
                result = resolve(call["fn"])(**call.get("kwargs", {}))
                if inspect.isawaitable(result):
                    result = self.loop.run_until_complete(result)
                answer = {"result": result}
            except Exception as e:  # the tool's failure is the model's to read
                answer = {"error": f"{type(e).__name__}: {e}"}
            with contextlib.suppress(OSError):  # the caller gave up on it
                stream.write(json.dumps(answer, default=str).encode() + b"\n")


class Host:
    """The workers: idle ones wait for a session; one that ends or is killed takes its processes along."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.home = os.getcwd()
        self.controls: dict[int, socket.socket] = {}
        self.idle: list[int] = []
        self.selector = selectors.DefaultSelector()

    def fork(self) -> int | None:
        """A new worker's pid; None if no process is left for one (the user's limit)."""
        ours, theirs = socket.socketpair()
        try:
            pid = os.fork()
        except OSError:
            ours.close()
            theirs.close()
            return None
        if pid == 0:
            try:
                # Nothing of the host's: not its sockets (a session's connection open in it would
                # never end), nor its input.
                keep = theirs.fileno()
                os.closerange(3, keep)
                os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                Worker(theirs, self.home, self.limits).serve()
            finally:
                os._exit(0)
        theirs.close()
        self.controls[pid] = ours
        self.selector.register(ours, selectors.EVENT_READ, pid)
        return pid

    def hand(self, conn: socket.socket) -> None:
        """`conn` served by an idle worker, or a new one; with no process left for one, the session
        fails (its connection closes unanswered)."""
        while (pid := self.idle.pop() if self.idle else self.fork()) is not None:
            try:
                socket.send_fds(self.controls[pid], [b"s"], [conn.fileno()])
                break
            except OSError:  # it died since it said it was idle
                self.end(pid)
        conn.close()

    def end(self, pid: int) -> None:
        """Worker `pid` killed with what it started; any process that escaped its group, too."""
        control = self.controls.pop(pid, None)
        if control is not None:
            self.selector.unregister(control)
            control.close()
        if pid in self.idle:
            self.idle.remove(pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        self.sweep()

    def sweep(self) -> None:
        """Every child that is not a worker (an orphan that came to this subreaper) killed."""
        while strays := [p for p in _children() if p not in self.controls]:
            for p in strays:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            for p in strays:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(p, 0)

    def close(self) -> None:
        for pid in list(self.controls):
            self.end(pid)


def main() -> None:
    path, modules = sys.argv[1], sys.argv[2:]
    host = Host(Limits.from_env())
    with heavy_imports():
        for module in modules:  # paid once, before the first worker forks; a function is called
            if ":" in module:
                resolve(module)()
            else:
                importlib.import_module(module)
    # What the imports made is never collected again: a worker's collections would otherwise touch
    # (and copy) every page of it.
    gc.collect()
    gc.freeze()
    _subreaper()
    signal.signal(signal.SIGCHLD, lambda *_: _reap())
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(socket.SOMAXCONN)  # a step's rollouts open their sessions at once
    host.selector.register(server, selectors.EVENT_READ, "server")
    host.selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
    print("ready", flush=True)
    while True:
        # The workers' news before new sessions: one that said it is idle serves the next.
        for key, _ in sorted(host.selector.select(), key=lambda e: e[0].data in ("server", "stdin")):
            if key.data == "server":
                host.hand(server.accept()[0])
            elif key.data == "stdin":
                line = sys.stdin.readline()
                if not line:  # the orchestrator's side is gone: so is every session
                    host.close()
                    return
                pid = json.loads(line).get("kill")
                if pid in host.controls:
                    host.end(pid)
            elif key.fileobj.recv(1) == b"d":  # its session is over, it waits for the next
                host.idle.append(key.data)
            else:  # it served its sessions, left a process behind, or died
                host.end(key.data)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


if __name__ == "__main__":
    main()
