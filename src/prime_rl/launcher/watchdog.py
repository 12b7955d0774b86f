"""Tell a run that hangs from one that works, name the process it hangs on, and take every stack.

The processes of a run say what they are doing (`prime_rl.runtime.activity`). The run makes progress while
any of them changes what it is doing, raises its progress counter, or reads or writes files in a
state marked `io`; a run whose states have all stood still for the stall timeout is stalled, and so
is one process that has been frozen that long while the others go on. The timeout adapts to the
run: STALL_FACTOR times the slowest trainer step seen so far (as the trainer times it; the first
step after a start or a restart not counted), at least `deployment.stall_floor_s`, and
`deployment.stall_first_step_s` until then; a fixed `deployment.stall_timeout_s` overrides it.

The culprit of a stall is the process that waits on no one: first one that is frozen (stopped by a
signal, no heartbeat, or an event loop that stopped beating), else one whose state waits for nobody
(one that another process waits for first), else the oldest state of the cycle that the processes'
waits form. When they wait, in the end, for a kind of process that is not on this machine, there
is no verdict here: that machine's watchdog has the culprit. The culprit's stack and every other
process's go to `logs/stall_<step>_<time>.txt` (`py-spy dump` where it can attach, else the
process's own `faulthandler`), and one line names it, what it was doing, since when, and the file.

Invariant: `Watchdog.check` reads the records and /proc and nothing else, and it declares a stall
at most once per stall: after one it waits a whole first-step timeout again.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from prime_rl.runtime.activity import STACK_SIGNAL, State, process_state, read_all

STALL_FACTOR = 5.0
"""Stall timeout = this many times the slowest trainer step so far (at least the floor)."""
FROZEN_S = 15.0
"""A process whose heartbeat (or event loop's beat) is this old is frozen."""
STACK_WAIT_S = 3.0
PY_SPY_TIMEOUT_S = 10.0


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
    _io: dict[int, int] = field(default_factory=dict)
    _progress_at: float = field(default_factory=time.time)
    _step: int | None = None
    """The trainer's step (None: not seen since the start or the last restart)."""
    _counts_from: int | None = None
    """The trainer's step from which the step times its records say count (module docstring)."""
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
        self._progress_at, self._slowest_s, self._step, self._counts_from = now, 0.0, None, None

    def check(
        self, now: float | None = None, host: str | None = None, keep: Callable[[State], bool] | None = None
    ) -> Stall | None:
        """Read the records (of `host`'s live processes, those `keep` keeps); a `Stall` when the run
        has not moved for the stall timeout, or when one process has been frozen that long."""
        now = time.time() if now is None else now
        states = [
            s
            for s in read_all(self.folder)
            if (host is None or s.host == host) and s.running() and (keep is None or keep(s))
        ]
        self.states = states
        seen = {s.pid: (s.doing, s.waits_on, s.step, s.since, s.progress) for s in states}
        io = {s.pid: n for s in states if s.io and (n := io_bytes(s.pid)) is not None}
        if any(self._seen.get(p) != sig for p, sig in seen.items()) or any(
            self._io.get(p) != n for p, n in io.items()
        ):
            self._progress_at = now
        self._seen, self._io = seen, io
        self._time_steps(states)
        timeout_s = self.stall_timeout_s()
        if not states or timeout_s <= 0:
            return None
        step = self._step
        # One frozen process is a hang even while the others go on (a server among several, one
        # env worker of many): nothing else would ever end it.
        long_frozen = [(s, why) for s in states if (why := frozen(s, now)) and now - beat_of(s) >= timeout_s]
        if long_frozen:
            culprit, why = min(long_frozen, key=lambda x: beat_of(x[0]))
            self.restarted(now)
            return Stall(
                culprit, why, now - beat_of(culprit), timeout_s, step if step is not None else culprit.step
            )
        idle_s = now - self._progress_at
        if idle_s < timeout_s:
            return None
        verdict = blame(states, now)
        self.restarted(now)  # one stall, one verdict: the next needs a whole timeout again
        if verdict is None:  # the run waits on a process of another machine: that one's watchdog sees it
            return None
        culprit, why = verdict
        return Stall(culprit, why, idle_s, timeout_s, step if step is not None else culprit.step)

    def _time_steps(self, states: list[State]) -> None:
        """The slowest trainer step so far, as the trainers' records say (`State.step_s`: each
        trainer times its own steps, so a poll that misses a step shorter than the polls' interval
        still reads the time of the one before). Times count from two steps past the step seen first
        after the start or a restart: the step then in progress may be waiting for the restarted
        process, and the next is the first whole one."""
        # A trainer's step in an io state is no news: while it loads it says 0, not yet the step it
        # resumes at (that jump is no step trained), and publishing or checkpointing repeats the
        # step it just trained.
        trainers = [s for s in states if s.kind == "trainer" and not s.io]
        if not trainers:
            return
        self._step = max(s.step for s in trainers)
        if self._counts_from is None:
            self._counts_from = self._step + 2
        if self._step >= self._counts_from:
            self._slowest_s = max(self._slowest_s, *(s.step_s for s in trainers))


def beat_of(s: State) -> float:
    """When `s` last showed life: its heartbeat, or its event loop's beat if that is older."""
    return min(s.beat, s.loop_beat) if s.loop_beat else s.beat


def io_bytes(pid: int) -> int | None:
    """Bytes `pid` has read and written so far (/proc/<pid>/io), None if unreadable."""
    try:
        lines = Path(f"/proc/{pid}/io").read_text().splitlines()
    except OSError:
        return None
    fields = dict(line.split(": ", 1) for line in lines if ": " in line)
    try:
        return int(fields["rchar"]) + int(fields["wchar"])
    except (KeyError, ValueError):
        return None


def look(
    dog: Watchdog, trees: dict[str, list[int]], log_dir: Path, host: str
) -> tuple[Stall, Path | None] | None:
    """One look at the run of `rl` on `host`, whose children's processes are `trees` (name -> pids):
    None, or a stall with every stack written to its file (None when it could not be written)."""
    ours = {pid for pids in trees.values() for pid in pids}
    stall = dog.check(host=host, keep=lambda s: s.pid in ours)
    if stall is None:
        return None
    path: Path | None = stack_file(log_dir, stall.step)
    try:
        write_stacks(path, stall, dog.states, trees, resume_stopped=True)
    except OSError as e:
        print(f"rl: cannot write the stacks to {path} ({e})", file=sys.stderr, flush=True)
        path = None
    return stall, path


def frozen(s: State, now: float) -> str:
    """How `s` is frozen, "" if it is not."""
    if process_state(s.pid) in ("T", "t"):
        return "frozen (stopped by a signal)"
    if now - s.beat > FROZEN_S:
        return f"frozen (no heartbeat for {now - s.beat:.0f} s)"
    if s.loop_beat and now - s.loop_beat > FROZEN_S:
        return f"frozen (its event loop has not run for {now - s.loop_beat:.0f} s)"
    return ""


def blame(states: list[State], now: float) -> tuple[State, str] | None:
    """The process a stall hangs on (module docstring), and how; None when the processes here all
    wait, in the end, for a kind of process that is not here (another machine's, or a server the
    run does not own)."""
    frozen_ones = [(s, why) for s in states if (why := frozen(s, now))]
    if frozen_ones:
        return min(frozen_ones, key=lambda x: beat_of(x[0]))
    working = [s for s in states if not s.waits_on]
    waited_for = {s.waits_on for s in states if s.waits_on}
    stuck = [s for s in working if s.kind in waited_for] or working
    if stuck:
        return min(stuck, key=lambda s: s.since), "stuck (it waits for nobody, and has not moved)"
    # Everybody waits: follow who waits for whom (the oldest state of each kind) to a kind that is
    # not here, or around a cycle (a lost message), whose oldest state is the culprit.
    oldest = {}
    for s in sorted(states, key=lambda s: s.since):
        oldest.setdefault(s.kind, s)
    path: list[State] = []
    at = min(states, key=lambda s: s.since)
    while at not in path:
        path.append(at)
        if at.waits_on not in oldest:
            return None
        at = oldest[at.waits_on]
    cycle = path[path.index(at) :]
    return min(cycle, key=lambda s: s.since), "waiting in a cycle (every process here waits for another)"


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
    return (
        f"rl: stall: no progress for {stall.idle_s:.0f} s (stall timeout {stall.timeout_s:.0f} s); "
        f"{c.label} (pid {c.pid}) is {stall.why}, in {describe(c)}{where}"
    )


def py_spy() -> str | None:
    """The `py-spy` executable: beside this Python's, or on PATH."""
    here = Path(sys.executable).parent / "py-spy"
    return str(here) if here.exists() else shutil.which("py-spy")


def stack_of(pid: int, state: State | None, resume_stopped: bool) -> str:
    """`pid`'s Python stacks, all threads: py-spy without stopping it (it also reads a stopped
    process), else its faulthandler (a stopped process is continued for it when `resume_stopped`)."""
    tool = py_spy()
    if tool:
        try:
            out = subprocess.run(
                [tool, "dump", "--nonblocking", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=PY_SPY_TIMEOUT_S,
            )
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
    path: Path, stall: Stall, states: list[State], trees: dict[str, list[int]], resume_stopped: bool
) -> None:
    """Every process's stacks into `path`, the culprit first. `trees`: name -> the processes of
    each child `rl` started (those without a record are dumped too, by py-spy)."""
    by_pid = {s.pid: s for s in states}
    order = [stall.culprit.pid, *(s.pid for s in states if s.pid != stall.culprit.pid)]
    names = {s.pid: s.label for s in states}
    for name, pids in trees.items():
        for pid in pids:
            if pid not in names:
                order.append(pid)
                names[pid] = f"a process of {name}"
    now = time.time()
    heads = {}
    for pid in order:
        s = by_pid.get(pid)
        head = [f"=== {names[pid]} (pid {pid}){' [culprit]' if pid == stall.culprit.pid else ''} ==="]
        if s is not None:
            head.append(
                f"state: {describe(s)}; heartbeat {now - s.beat:.1f} s ago; process state "
                f"{process_state(pid) or '?'}"
            )
        heads[pid] = head
    # All at once: py-spy may take seconds per process, and the culprit waits to be killed meanwhile.
    with ThreadPoolExecutor(max_workers=8) as pool:
        stacks = pool.map(
            lambda pid: stack_of(pid, by_pid.get(pid), resume_stopped and pid == stall.culprit.pid), order
        )
    lines = [stall_line(stall, None).removeprefix("rl: "), ""]
    for pid, stack in zip(order, stacks, strict=True):
        lines += [*heads[pid], stack.rstrip() + "\n"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))


def stack_file(log_dir: Path, step: int, now: float | None = None) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    return Path(log_dir) / f"stall_{step}_{stamp}.txt"
