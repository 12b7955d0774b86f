"""`uv run watchdog --output-dir DIR`: the watchdog of `rl` for processes started by hand.

It reads the activity records of the run in DIR (this machine's processes), and on a stall writes
every stack to DIR/logs/stall_<step>_<time>.txt and prints the line that names the culprit; with
`--kill` it also kills the culprit (SIGKILL), so that whatever started it (systemd, SLURM, a shell
loop) can start it again. It never restarts anything itself, and keeps watching until stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

from pydantic import Field

from prime_rl.config import parse_config
from prime_rl.config.base import RootConfig
from prime_rl.config.defaults import DEFAULT_OUTPUT_DIR
from prime_rl.launcher.watchdog import Watchdog, stack_file, stall_line, write_stacks
from prime_rl.runtime import activity


class WatchdogConfig(RootConfig):
    """The standalone watchdog."""

    output_dir: Path = DEFAULT_OUTPUT_DIR
    """The run folder the processes write to (their records are in <output_dir>/activity)."""

    stall_timeout_s: float | None = Field(default=None, ge=0)
    """Seconds without a change in any process's activity after which the run counts as hung.
    Unset: 5 times the slowest trainer step seen, at least stall_floor_s; stall_first_step_s before
    the first step."""

    stall_floor_s: float = Field(default=60.0, gt=0)
    """The adaptive stall timeout is never shorter than this."""

    stall_first_step_s: float = Field(default=600.0, gt=0)
    """The stall timeout until the first trainer step seen, and after each stall."""

    kill: bool = False
    """Kill the culprit of a stall (SIGKILL; a stopped process too)."""

    poll_s: float = Field(default=1.0, gt=0)
    """How often to read the records."""


def kill(pid: int) -> None:
    """SIGKILL `pid`, and its process group when it leads one (vLLM's engine core goes with its
    server, which `inference` starts as a group of its own)."""
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    config = parse_config(WatchdogConfig, argv, prog="watchdog")
    out = Path(config.output_dir)
    dog = Watchdog(
        activity.folder(out), config.stall_timeout_s, config.stall_floor_s, config.stall_first_step_s
    )
    print(f"watchdog: watching the processes of {out} on {socket.gethostname()}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        while True:
            stall = dog.check(host=socket.gethostname())
            if stall is not None:
                path = stack_file(out / "logs", stall.step)
                write_stacks(path, stall, dog.states, {}, resume_stopped=config.kill)
                print(stall_line(stall, path).replace("rl: ", "watchdog: ", 1), flush=True)
                if config.kill and stall.culprit.running():
                    kill(stall.culprit.pid)
                    print(f"watchdog: killed {stall.culprit.label} (pid {stall.culprit.pid})", flush=True)
            time.sleep(config.poll_s)
    except KeyboardInterrupt:
        raise SystemExit(130) from None
