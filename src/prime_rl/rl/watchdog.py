"""Tell a run that hangs from one that works, name the process it hangs on, and take every stack.

The processes of a run say what they are doing (`prime_rl.activity`). The run makes progress while
any of them changes what it is doing; a run whose states have all stood still for the stall timeout
is stalled. The timeout adapts to the run: STALL_FACTOR times the slowest trainer step seen so far,
at least `deployment.stall_floor_s`, and `deployment.stall_first_step_s` until the first step
(and again after a restart); a fixed `deployment.stall_timeout_s` overrides it.

The culprit of a stall is the process that waits on no one: first one that is frozen (stopped by a
signal, no heartbeat, or an event loop that stopped beating), else one whose state waits for nobody
and that another process waits for, else the one whose state is the oldest. Its stack and every
other process's go to `logs/stall_<step>_<time>.txt` (`py-spy dump` where it can attach, else the
process's own `faulthandler`), and one line names it, what it was doing, since when, and the file.

Invariant: `Watchdog.check` reads the records and nothing else until it declares a stall, and it
declares a stall at most once per stall: after one it waits a whole first-step timeout again.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prime_rl.activity import STACK_SIGNAL, State, process_state, read_all

STALL_FACTOR = 5.0
"""Stall timeout = this many times the slowest trainer step so far (at least the floor)."""
FROZEN_S = 15.0
"""A process whose heartbeat (or event loop's beat) is this much older than the others' is frozen."""
STACK_WAIT_S = 3.0


@dataclass(frozen=True)
class Stall:
    culprit: State
    why: str
    """How the culprit hangs: "frozen (stopped by a signal)", "stuck in its state", ..."""
    idle_s: float
    """Seconds without progress."""
    timeout_s: float
    step: int
    """The trainer's step (the culprit's without a trainer record)."""


@dataclass
class Watchdog:
    folder: Path
    """The run's activity records."""
    timeout_s: float | None = None
    """Fixed stall timeout; None adapts (module docstring)."""
    floor_s: float = 60.0
    first_step_s: float = 600.0
    states: list[State] = field(default_factory=list)
    _seen: dict[int, tuple] = field(default_factory=dict)
    _progress_at: float = field(default_factory=time.time)
    _step: int | None = None
    _step_at: float = 0.0
    _slowest_s: float = 0.0

    def stall_timeout_s(self) -> float:
        if self.timeout_s is not None:
            return self.timeout_s
        if self._slowest_s == 0.0:
            return self.first_step_s
        return max(self.floor_s, STALL_FACTOR * self._slowest_s)

    def idle_s(self, now: float | None = None) -> float:
        """Seconds since a process last changed what it is doing."""
        return (time.time() if now is None else now) - self._progress_at

    def restarted(self, now: float | None = None) -> None:
        """A process was restarted: its successor gets the first step's time again."""
        now = time.time() if now is None else now
        self._progress_at, self._slowest_s, self._step = now, 0.0, None

    def check(
        self, now: float | None = None, host: str | None = None, keep: Callable[[State], bool] | None = None
    ) -> Stall | None:
        """Read the records (of `host`'s live processes, those `keep` keeps); a `Stall` when the run
        has not moved for the stall timeout."""
        now = time.time() if now is None else now
        states = [
            s
            for s in read_all(self.folder)
            if (host is None or s.host == host) and s.running() and (keep is None or keep(s))
        ]
        self.states = states
        seen = {s.pid: (s.doing, s.waits_on, s.step, s.since) for s in states}
        if any(self._seen.get(pid) != sig for pid, sig in seen.items()):
            self._progress_at = now
        self._seen = seen
        steps = [s.step for s in states if s.kind == "trainer"]
        if steps:
            step = max(steps)
            if self._step is not None and step > self._step:
                self._slowest_s = max(self._slowest_s, now - self._step_at)
            if self._step is None or step != self._step:
                self._step, self._step_at = step, now
        idle_s = now - self._progress_at
        timeout_s = self.stall_timeout_s()
        if not states or timeout_s <= 0 or idle_s < timeout_s:
            return None
        culprit, why = blame(states, now)
        self.restarted(now)  # one stall, one verdict: the next needs a whole timeout again
        return Stall(culprit, why, idle_s, timeout_s, self._step if self._step is not None else culprit.step)


def frozen(s: State, now: float) -> str:
    """How `s` is frozen, "" if it is not."""
    if process_state(s.pid) in ("T", "t"):
        return "frozen (stopped by a signal)"
    if now - s.beat > FROZEN_S:
        return f"frozen (no heartbeat for {now - s.beat:.0f} s)"
    if s.loop_beat and now - s.loop_beat > FROZEN_S:
        return f"frozen (its event loop has not run for {now - s.loop_beat:.0f} s)"
    return ""


def blame(states: list[State], now: float) -> tuple[State, str]:
    """The process a stall hangs on (module docstring), and how."""
    frozen_ones = [(s, why) for s in states if (why := frozen(s, now))]
    if frozen_ones:
        return min(frozen_ones, key=lambda x: x[0].beat)
    waited_for = {s.waits_on for s in states if s.waits_on}
    working = [s for s in states if not s.waits_on]
    stuck = [s for s in working if s.kind in waited_for] or working
    if stuck:
        return min(stuck, key=lambda s: s.since), "stuck (it waits for nobody, and has not moved)"
    return min(states, key=lambda s: s.since), "waiting the longest (every process waits for another)"


def describe(s: State) -> str:
    waits = f"waiting for the {s.waits_on}" if s.waits_on else "waiting for nobody"
    return f'"{s.doing}" ({waits}) since {time.strftime("%H:%M:%S", time.localtime(s.since))}'


def waiting_line(states: list[State], idle_s: float) -> str:
    """What every process is doing, in one console line, while the run has not moved for a while."""
    doing = "; ".join(f"{s.label} {describe(s)}" for s in sorted(states, key=lambda s: s.label))
    return f"rl: nothing moved for {idle_s:.0f} s: {doing}"


def stall_line(stall: Stall, stack_file: Path | None) -> str:
    c = stall.culprit
    where = f"; stacks in {stack_file}" if stack_file else ""
    return (f"rl: stall: no progress for {stall.idle_s:.0f} s (stall timeout {stall.timeout_s:.0f} s); "
            f"{c.label} (pid {c.pid}) is {stall.why}, in {describe(c)}{where}")  # fmt: skip


def py_spy() -> str | None:
    """The `py-spy` executable: beside this Python's, or on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def group_pids(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (read from /proc)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = (entry / "stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                if int(fields[2]) == pgid and fields[0] != "Z":
                    out.append(int(entry.name))
    return sorted(out)


def stack_of(pid: int, state: State | None, resume_stopped: bool) -> str:
    """`pid`'s Python stacks, all threads: py-spy without stopping it (it also reads a stopped
    process), else its faulthandler (a stopped process is continued for it when `resume_stopped`)."""
    tool = py_spy()
    if tool:
        try:
            out = subprocess.run([tool, "dump", "--nonblocking", "--pid", str(pid)],
                                 capture_output=True, text=True, timeout=20)  # fmt: skip
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout
            failed = (out.stderr or out.stdout).strip().splitlines()[:2]
        except (OSError, subprocess.TimeoutExpired) as e:
            failed = [str(e)]
    else:
        failed = ["py-spy is not installed"]
    if state is None:
        return f"(no stack: {'; '.join(failed)}; no activity record to ask for one)\n"
    path = state.stack_path
    before = path.stat().st_size if path.exists() else 0
    try:
        os.kill(pid, STACK_SIGNAL)
    except ProcessLookupError:
        return "(gone)\n"
    deadline = time.monotonic() + STACK_WAIT_S
    while time.monotonic() < deadline:
        if resume_stopped and process_state(pid) in ("T", "t"):
            # The handler runs once the process runs (checked in the loop: a stop signal sent just
            # before takes effect asynchronously).
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if path.exists() and path.stat().st_size > before:
            time.sleep(0.2)  # let it finish writing every thread
            with path.open() as f:
                f.seek(before)
                return f.read()
        time.sleep(0.05)
    return f"(no stack: {'; '.join(failed)}; its faulthandler did not answer within {STACK_WAIT_S:.0f} s)\n"


def write_stacks(
    path: Path, stall: Stall, states: list[State], groups: dict[str, int], resume_stopped: bool
) -> None:
    """Every process's stacks into `path`, the culprit first. `groups`: name -> process group of
    each process `rl` started (their processes without a record are dumped too, by py-spy)."""
    by_pid = {s.pid: s for s in states}
    order = [stall.culprit.pid, *(s.pid for s in states if s.pid != stall.culprit.pid)]
    names = {s.pid: s.label for s in states}
    for name, pgid in groups.items():
        for pid in group_pids(pgid):
            if pid not in names:
                order.append(pid)
                names[pid] = f"{name} (process group {pgid})"
    now = time.time()
    lines = [stall_line(stall, None).removeprefix("rl: "), ""]
    for pid in order:
        s = by_pid.get(pid)
        title = f"=== {names[pid]} (pid {pid}){' [culprit]' if pid == stall.culprit.pid else ''} ==="
        lines.append(title)
        if s is not None:
            lines.append(f"state: {describe(s)}; heartbeat {now - s.beat:.1f} s ago; process state "
                         f"{process_state(pid) or '?'}")  # fmt: skip
        lines.append(stack_of(pid, s, resume_stopped and pid == stall.culprit.pid).rstrip() + "\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def stack_file(log_dir: Path, step: int, now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    return Path(log_dir) / f"stall_{step}_{stamp}.txt"
