"""What each process of a run is doing now, and since when: one small record per process (per
trainer rank, per env worker), which `rl`'s watchdog (`launcher/watchdog.py`) reads to tell a run that
hangs from one that works, and to name the process that hangs.

A record is a 4 KiB file `<output_dir>/activity/<label>.<pid>` that the process maps into memory:

    [0:8]   sequence number (u64), odd while a state is being written
    [8:16]  heartbeat: wall time (f64), written every BEAT_S by a thread of the process
    [16:24] loop beat: wall time (f64), written every BEAT_S by its asyncio loop (0: no loop)
    [24:28] length of the state (u32), then the state as JSON: label, kind, pid, host, started
            (the kernel's start time of the process, so that a reused pid is not taken for it),
            doing, waits_on, step, since, io, progress, step_s

A process that stops beating is frozen (SIGSTOP, a C call that holds the GIL, a dead-locked
interpreter); one whose loop stops beating has a blocked event loop; one that beats but whose state
has not changed for a long time is stuck in what its state says. `waits_on` names the kind of
process it waits for ("" when it waits for nobody): the watchdog follows these to the culprit.
A state marked `io` (loading or writing checkpoints and weights) also moves while the process reads
or writes (its /proc I/O counters); `progress` is a counter a process raises while one state lasts
(a server's engine outputs while it generates).

Invariants: setting a state is a memory copy into a shared page, no system call, no host-device
sync and no collective, so it may be called anywhere, often; a reader never takes a half-written
state for a whole one (the sequence number); without `start` every call here does nothing (tests
that run a loop in a thread, processes outside a run). Each process also registers `faulthandler`
for STACK_SIGNAL, writing every thread's stack to `<label>.<pid>.stack` beside its record: the
watchdog's way to the stacks where `py-spy` cannot attach. And a process that dies of a fatal
signal (a segfault, an abort from a heap check) first writes every thread's stack to its stderr (its
log under `rl`), so that a native crash names where each thread was.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import mmap
import os
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

SIZE = 4096
HEADER = struct.Struct("<QddI")
BEAT_S = 1.0
"""How often a process says it is alive (thread and event loop)."""
STACK_SIGNAL = signal.SIGUSR1
ENV_DIR = "PRIME_RL_ACTIVITY_DIR"
"""Set by `rl` for its children (a teacher server's output dir is another): the folder of the run's
records (default: <output_dir>/activity)."""
ENGINE_CORE = "engine-core"
"""The label of the record of vLLM's engine core in engine mode (`engine/core_record.py`), a process
of kind "inference" that its parent, the orchestrator, restarts when it dies."""
ENV_LABEL = "PRIME_RL_ACTIVITY_LABEL"
"""Set by `rl` for its servers (inference-1, teacher, ...): the record's label."""


def folder(output_dir: Path | str) -> Path:
    return Path(os.environ.get(ENV_DIR) or Path(output_dir) / "activity")


@dataclass(frozen=True)
class State:
    """A process's state as the watchdog reads it."""

    label: str
    """trainer-rank0, orchestrator, env-worker-1, inference, ..."""
    kind: str
    """trainer, orchestrator, env-worker or inference."""
    pid: int
    host: str
    started: int
    """The process's start time in clock ticks since boot (/proc/<pid>/stat), 0 if unknown."""
    doing: str
    """What it is doing, in words: "waiting for the micro-batches of step 9"."""
    waits_on: str
    """The kind of process it waits for, "" when it waits for nobody (it is working)."""
    step: int
    since: float
    """Wall time at which it began `doing`."""
    io: bool
    """Reading or writing files is progress in this state."""
    progress: int
    """A counter the process raises while the state lasts."""
    beat: float
    """Wall time of its last heartbeat."""
    loop_beat: float
    """Wall time of its event loop's last beat, 0.0 for a process without one."""
    path: Path
    step_s: float = 0.0
    """How long its last whole step took (a trainer's; 0.0 until it has trained one past its first,
    which holds the model's load): the watchdog's measure of a step, whichever polls it missed."""

    @property
    def stack_path(self) -> Path:
        return self.path.with_name(self.path.name + ".stack")

    def running(self) -> bool:
        """Whether the process that wrote this record is still running (not a later process that
        was given the same pid, not a zombie)."""
        return alive(self.pid) and start_ticks(self.pid) == self.started


class _Record:
    def __init__(self, path: Path, label: str, kind: str):
        self.path = path
        self.fields = {
            "label": label,
            "kind": kind,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": start_ticks(os.getpid()),
            "doing": "starting",
            "waits_on": "",
            "step": 0,
            "since": time.time(),
            "io": False,
            "progress": 0,
            "step_s": 0.0,
        }
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            # Written, not truncated to size: a sparse page would be allocated at the first store
            # through the map, and on a full disk that store is a SIGBUS; a write fails with OSError.
            if os.write(fd, bytes(SIZE)) != SIZE:
                raise OSError("short write")
            self.map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        self.seq = 0
        self.lock = threading.Lock()
        self._write_state()

    def _write_state(self) -> None:
        body = json.dumps(self.fields).encode()[: SIZE - HEADER.size]
        with self.lock:  # threads of one process may set states at once (the beats touch other bytes)
            self.seq += 1
            self.map[0:8] = struct.pack("<Q", self.seq)
            self.map[24:28] = struct.pack("<I", len(body))
            self.map[HEADER.size : HEADER.size + len(body)] = body
            self.seq += 1
            self.map[0:8] = struct.pack("<Q", self.seq)

    def set(self, doing: str, waits_on: str, step: int | None, io: bool = False) -> None:
        f = self.fields
        step = f["step"] if step is None else step
        if f["doing"] == doing and f["waits_on"] == waits_on and f["step"] == step and f["io"] == io:
            return
        f["doing"], f["waits_on"], f["step"], f["since"], f["io"] = doing, waits_on, step, time.time(), io
        self._write_state()

    def advance(self, progress: int) -> None:
        if self.fields["progress"] != progress:
            self.fields["progress"] = progress
            self._write_state()

    def took(self, seconds: float) -> None:
        self.fields["step_s"] = seconds
        self._write_state()

    def beat(self, offset: int) -> None:
        self.map[offset : offset + 8] = struct.pack("<d", time.time())


_record: _Record | None = None


def _forget_in_child() -> None:
    # A forked child (vLLM's engine core, forked from the orchestrator) is another process: it must
    # not write its parent's record, and it keeps one of its own only if it starts it.
    global _record
    _record = None


os.register_at_fork(after_in_child=_forget_in_child)


def start(label: str, kind: str, output_dir: Path | str, doing: str = "starting") -> None:
    """Keep this process's record from now on (one per process: a second call does nothing)."""
    global _record
    if _record is not None:
        return
    where = folder(output_dir)
    path = where / f"{label}.{os.getpid()}"
    try:
        where.mkdir(parents=True, exist_ok=True)
        record = _Record(path, label, kind)
        # Kept open for the life of the process: faulthandler writes to its descriptor from the
        # signal handler.
        stacks = path.with_name(path.name + ".stack").open("a")
        faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True, chain=False)
        if not faulthandler.is_enabled() and sys.__stderr__ is not None:
            faulthandler.enable(file=sys.__stderr__, all_threads=True)
    except OSError:  # an unwritable run folder is reported by whoever writes there next
        with contextlib.suppress(OSError):
            path.unlink()  # a record that would never beat would look frozen
        return
    _record = record
    record.beat(8)
    record.set(doing, "", None)
    threading.Thread(target=_beat_until_stopped, args=(record,), daemon=True, name="activity-beat").start()
    atexit.register(stop)


def _beat_until_stopped(record: _Record) -> None:
    # Ends with `stop`: a process that runs mains one after another (the tests) starts a record,
    # and so a thread, for each.
    while _record is record:
        record.beat(8)
        time.sleep(BEAT_S)


async def beat_loop() -> None:
    """Run as a task of an asyncio process: its loop beats, so that a blocked loop is seen."""
    import asyncio

    try:
        while _record is not None:
            loop_beat()
            await asyncio.sleep(BEAT_S)
    finally:  # the loop stops beating on purpose (its process winds down): no loop to watch now
        if _record is not None:
            _record.map[16:24] = struct.pack("<d", 0.0)


def loop_beat() -> None:
    """The event loop is alive (call from a task of the loop, every BEAT_S)."""
    if _record is not None:
        _record.beat(16)


def doing(what: str, waits_on: str = "", step: int | None = None, io: bool = False) -> None:
    """Say what this process is doing now (`waits_on`: the kind of process it waits for; `io`:
    reading or writing files is progress while it lasts)."""
    if _record is not None:
        _record.set(what, waits_on, step, io)


def progress(count: int) -> None:
    """Say that the current state moves on (`count` grows while it does)."""
    if _record is not None:
        _record.advance(count)


def step_took(seconds: float) -> None:
    """Say how long the step just trained took, start to start (not for the first step after the
    process started: it holds the model's load and the first rollouts)."""
    if _record is not None:
        _record.took(seconds)


@contextlib.contextmanager
def waiting(what: str, on: str):
    """Inside, this process's state is its current one plus `what`, waiting for the `on` kind (a
    collective: the other ranks); the state before comes back after."""
    record = _record
    if record is None:
        yield
        return
    doing, waits_on = record.fields["doing"], record.fields["waits_on"]
    record.set(f"{doing}, in {what}", on, None)
    try:
        yield
    finally:
        record.set(doing, waits_on, None)


def now() -> str:
    """What this process is doing (for its own log lines), "" without a record."""
    return _record.fields["doing"] if _record is not None else ""


def stop() -> None:
    """Remove this process's record and stack file (at a clean exit; a killed process leaves them,
    and readers tell by `State.running`)."""
    global _record
    if _record is not None:
        for path in (_record.path, _record.path.with_name(_record.path.name + ".stack")):
            with contextlib.suppress(OSError):
                path.unlink()
        _record = None


def read(path: Path) -> State | None:
    """The state in the record at `path`, None if it is gone or unreadable."""
    for _ in range(20):
        try:
            data = path.read_bytes()
        except OSError:
            return None
        if len(data) < HEADER.size:
            return None
        seq, beat, loop_beat, length = HEADER.unpack_from(data)
        if seq % 2 == 0 and seq > 0 and _sequence(path) == seq:  # no write began since: whole
            try:
                f = json.loads(data[HEADER.size : HEADER.size + length])
                return State(
                    f["label"],
                    f["kind"],
                    int(f["pid"]),
                    f["host"],
                    int(f.get("started", 0)),
                    f["doing"],
                    f["waits_on"],
                    int(f["step"]),
                    float(f["since"]),
                    bool(f.get("io", False)),
                    int(f.get("progress", 0)),
                    beat,
                    loop_beat,
                    path,
                    float(f.get("step_s", 0.0)),
                )
            except (ValueError, KeyError, TypeError):
                pass
        time.sleep(0.001)
    return None


def _sequence(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return struct.unpack("<Q", f.read(8))[0]
    except (OSError, struct.error):
        return -1


def read_all(where: Path) -> list[State]:
    """Every readable record under `where` (also those of processes that are gone: `State.running`)."""
    try:
        paths = [p for p in where.iterdir() if not p.name.endswith(".stack")]
    except OSError:
        return []
    return [s for p in sorted(paths) if (s := read(p)) is not None]


def forget_gone(where: Path, host: str) -> None:
    """Remove the records (and stack files) of `host`'s processes that are gone: an earlier
    session's, or a killed process's."""
    for state in read_all(where):
        if state.host == host and not state.running():
            for path in (state.path, state.stack_path):
                with contextlib.suppress(OSError):
                    path.unlink()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) is not alive.
    return process_state(pid) not in ("Z", "X", "")


def start_ticks(pid: int) -> int:
    """When `pid` started, in clock ticks since boot (0 if unknown): with the pid, names a process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def process_state(pid: int) -> str:
    """The kernel's state letter of `pid` (R, S, D, T stopped, t traced, Z zombie), "" if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat[stat.rindex(")") + 2 :].split(" ", 1)[0]
