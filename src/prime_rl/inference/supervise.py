"""`uv run inference`: vLLM's server as a child of this process, which stops it on Ctrl-C or SIGTERM.

Invariant: vLLM runs in a session of its own, so the terminal's Ctrl-C reaches this process only
(left to itself, vLLM printed a traceback when stopped while starting and exited with status 0 when
stopped while serving). On the first SIGINT or SIGTERM this process stops vLLM's whole process group
(SIGTERM, then SIGKILL after STOP_WAIT_S), says one line and exits with 128 + the signal; vLLM's
output from then on goes to `<output_dir>/inference/stop.log`, not the console. A server that joined
a run's pool (`member.py`) first leaves it, its groups drained, and then exits 0. If this process is
killed, vLLM gets SIGTERM (the parent-death signal), so no server outlives it. Otherwise vLLM's
output passes through unchanged, byte for byte, and its exit status is this process's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from prime_rl.inference.member import NEEDS_USER, Member
from prime_rl.runtime import shutdown

STOP_WAIT_S = 3.0
"""How long vLLM may take to stop on SIGTERM before its process group is killed (it took 0.5 s
serving the tiny model; within `shutdown.GRACE_S`)."""

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # In the child, before exec: SIGTERM when the thread that started it (our main thread) ends.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class _Pump:
    """Copies a child's stream to ours, or to a file once the stop began (byte for byte: vLLM's
    progress bars rewrite their line)."""

    def __init__(self, source: BinaryIO, sink: BinaryIO):
        self.source, self.sink = source, sink
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def redirect(self, sink: BinaryIO) -> None:
        with self.lock:
            self.sink = sink

    def _run(self) -> None:
        while chunk := os.read(self.source.fileno(), 65536):
            with self.lock, contextlib.suppress(OSError, ValueError):  # a closed console or log
                self.sink.write(chunk)
                self.sink.flush()


def run_server(cmd: list[str], env: dict[str, str], run_dir: Path, member: Member | None = None) -> int:
    """Run vLLM's server until it exits (its status) or this process is stopped (128 + signal).
    With `member` (`pool.join`), the server registers with the run once healthy, and on the stop
    leaves it first (0, once the orchestrator let it go); a refused registration stops it (2)."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    shutdown.at_deadline(lambda: _kill_group(proc, signal.SIGKILL))
    pumps: list[_Pump] = []
    stopping = threading.Event()
    try:
        pumps += [_Pump(proc.stdout, sys.stdout.buffer), _Pump(proc.stderr, sys.stderr.buffer)]
        if member is not None:
            threading.Thread(target=_join, args=(member, proc, stopping), daemon=True).start()
        code = proc.wait()
    except shutdown.Stopped:
        stopping.set()
        left = member is not None and member.leave()  # vLLM serves its groups in flight meanwhile
        run_dir.mkdir(parents=True, exist_ok=True)  # nothing else may have made it (a short TMPDIR elsewhere)
        log = (run_dir / "stop.log").open("ab")
        for pump in pumps:
            pump.redirect(log)
        _stop(proc)
        return 0 if left else 128 + (shutdown.stopping() or signal.SIGINT)
    for pump in pumps:  # the rest of what it wrote, before the status
        pump.thread.join(timeout=5)
    if member is not None and member.refused:
        return NEEDS_USER
    if member is not None and member.run_over:
        return 0
    return code


def _join(member: Member, proc: subprocess.Popen, stopping: threading.Event) -> None:
    member.join(stopping)  # returns once refused, or once the run it joined is over
    if member.refused or member.run_over:  # nobody sends it work: stop it (the status says why)
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the group; SIGKILL whatever of it is left after STOP_WAIT_S. The rest of the group
    (the engine, its workers, the resource tracker that frees their shared memory) is waited for too:
    killed mid-cleanup, the tracker would leave the shared memory behind."""
    deadline = time.monotonic() + STOP_WAIT_S
    _kill_group(proc, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=STOP_WAIT_S)
    while _kill_group(proc, 0) and time.monotonic() < deadline:
        time.sleep(0.05)
    _kill_group(proc, signal.SIGKILL)
    proc.wait()


def _kill_group(proc: subprocess.Popen, sig: int) -> bool:
    """Send `sig` to the child's process group; False once the group is gone."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True
