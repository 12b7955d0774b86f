"""One child process of `rl`: started in a session of its own on its cores, its output copied to its
log file and its telling lines to the console.

Invariant: a child's output is always drained, whatever becomes of its log file (a full disk is
said once, then the lines go to the console only), so that no child ever blocks on a full pipe.
A child is started again by the very call that started it (`Child.spawn`), plus the arguments it
resumes with.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from prime_rl.runtime.disk import writing
from prime_rl.runtime.logging_setup import ROLLOUT_FAILED

# Console view: the lines that say what each process is doing; everything is in the log files.
# vLLM's own records (its engine in the orchestrator's process logs there too) stay in the log,
# whatever words they happen to contain ("waiting for worker exit" at every shutdown), with the lines
# that continue them (a traceback): the process's own line says what happened, once.
VLLM_RECORD = re.compile(r"\b(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d ")
OWN_LINE = re.compile(r"^(?:\d\d:\d\d:\d\d [\w-]+ |[\w-]+: (?:error|refused)\b|prime_rl: )")
"""A line of our own processes' (their log format, their one-line errors): it ends a vLLM record."""
CONSOLE_MARKERS = (
    " step ",
    "error",
    "Error",
    "resum",
    "restarting",
    "waiting",
    "eval at",
    "saved",
    "Traceback",
)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    group: str = ""
    """Servers of one group stand in for each other: the run goes on while one of them lives
    (default: the child's name, a group of its own)."""
    spawn: Callable[[], subprocess.Popen] | None = None
    """Starts the child again (same command, environment and cores, plus `again`), for restarts."""
    restarts: int = 0
    hung: bool = False
    """Killed by the watchdog: it hung (the console says so instead of its exit status)."""

    def __post_init__(self):
        self.group = self.group or self.name

    @property
    def kind(self) -> str:
        """inference, teacher, trainer or orchestrator (servers `inference-<i>` are one kind)."""
        return self.name.split("-")[0]


def start_child(
    name: str,
    cmd: list[str],
    env: dict[str, str],
    cpus: list[int] | None,
    log_path: Path,
    console: bool,
    group: str = "",
    again: tuple[str, ...] = (),
    quiet: tuple[str, ...] = (),
) -> Child:
    """Start a child; `again`: arguments added when it is restarted (resume where it stopped);
    `quiet`: the URLs of servers whose start `rl` reports itself, so the child's lines saying it
    waits for one of them stay in its log."""
    with writing(log_path, "the logs"):
        log_path.parent.mkdir(parents=True, exist_ok=True)
    started = []

    def spawn() -> subprocess.Popen:
        proc = subprocess.Popen(
            [*cmd, *again] if started else cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: we stop it and everything it started
            preexec_fn=_affinity(cpus),
        )
        threading.Thread(
            target=_pump, args=(name, proc.stdout, log_path, console, quiet), daemon=True
        ).start()
        started.append(proc.pid)
        return proc

    return Child(name, spawn(), log_path, group, spawn)


def _affinity(cpus: list[int] | None):
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _pump(name: str, stdout: IO[str], log_path: Path, console: bool, quiet: tuple[str, ...] = ()) -> None:
    """Copy a child's output to its log file and the interesting lines to the console. A log file
    that cannot be written (a full disk) is said once; the output is still drained, so the child
    never blocks on a full pipe, and its console lines (its own error line among them) still show."""
    log: IO[str] | None = None
    try:
        log = log_path.open("a")
    except OSError as e:
        _log_lost(log_path, e)
    vllm = False
    """Whether the line is (still) part of a record of vLLM's."""
    for line in stdout:
        vllm = bool(VLLM_RECORD.search(line)) or (vllm and not OWN_LINE.match(line))
        if log is not None:
            try:
                log.write(line)
                log.flush()
            except OSError as e:
                _log_lost(log_path, e)
                with contextlib.suppress(OSError):
                    log.close()
                log = None
        if (
            (console or ": error: " in line)
            and any(m in line for m in CONSOLE_MARKERS)
            and ROLLOUT_FAILED not in line
            and not vllm
            and not ("waiting for" in line and any(url in line for url in quiet))
        ):
            sys.stdout.write(f"[{name}] {line}" if not line.startswith(("[", " ")) else line)
            sys.stdout.flush()
    if log is not None:
        with contextlib.suppress(OSError):
            log.close()


def _log_lost(path: Path, e: OSError) -> None:
    print(
        f"rl: cannot write {path} ({e.strerror or e}); that process's output is not logged from here on",
        file=sys.stderr,
        flush=True,
    )
