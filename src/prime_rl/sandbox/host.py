"""A tool host: one sandboxed process that imports what the tools need once, then serves each
session (a rollout's tool calls) in a forked child of its own.

    python -m prime_rl.sandbox.host <socket path> <module or module:function> ...

Runs inside the sandbox (`tools_host.py` starts it there). It listens on a unix socket in its
scratch folder; each connection is a session: a child is forked for it (the imports are paid once,
and a session's state dies with it), which first says its pid, then answers JSON lines
`{"fn": "module:qualname", "kwargs": {...}}` with `{"result": ...}` or `{"error": "..."}` until the
connection closes. On its standard input the host takes `{"kill": <pid>}` (a session's process group
killed: at the end of its rollout, or past its deadline); at the input's end it kills all and exits.

Invariant: a call's failure is an answer, never the host's crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import os
import resource
import selectors
import signal
import socket
import sys


def _resolve(spec: str):
    module, _, qualname = spec.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _session(conn: socket.socket, cpu_s: int, memory_mb: int) -> None:
    """In the forked child: answer the session's calls until its connection closes."""
    os.setpgid(0, 0)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    limit = size + memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    quiet = os.open(os.devnull, os.O_WRONLY)  # what a tool prints goes nowhere: nobody reads it
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    stream = conn.makefile("rwb", buffering=0)
    stream.write(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    for line in stream:
        try:
            call = json.loads(line)
            result = _resolve(call["fn"])(**call.get("kwargs", {}))
            if inspect.isawaitable(result):
                result = asyncio.run(result)
            answer = {"result": result}
        except Exception as e:  # the tool's failure is the model's to read
            answer = {"error": f"{type(e).__name__}: {e}"}
        stream.write(json.dumps(answer, default=str).encode() + b"\n")


def main() -> None:
    path, modules = sys.argv[1], sys.argv[2:]
    cpu_s = int(os.environ.get("PRIME_RL_SESSION_CPU_S", "10"))
    memory_mb = int(os.environ.get("PRIME_RL_SESSION_MEMORY_MB", "1024"))
    for module in modules:  # paid once, before the first session forks; a function is called
        if ":" in module:
            _resolve(module)()
        else:
            importlib.import_module(module)
    signal.signal(signal.SIGCHLD, lambda *_: _reap())
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(socket.SOMAXCONN)  # a step's rollouts open their sessions at once
    sessions: set[int] = set()
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)
    print("ready", flush=True)
    while True:
        for key, _ in selector.select():
            if key.fileobj is server:
                conn, _ = server.accept()
                try:
                    pid = os.fork()
                except OSError:  # no process left for it (the user's limit): this session fails
                    conn.close()
                    continue
                if pid == 0:
                    selector.close()
                    server.close()
                    try:
                        _session(conn, cpu_s, memory_mb)
                    finally:
                        os._exit(0)
                sessions.add(pid)
                conn.close()
                continue
            line = sys.stdin.readline()
            if not line:  # the orchestrator's side is gone: so is every session
                for pid in sessions:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                return
            pid = json.loads(line).get("kill")
            if pid in sessions:
                sessions.discard(pid)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


if __name__ == "__main__":
    main()
