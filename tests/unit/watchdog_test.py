"""The activity records and the watchdog's verdicts: what a process says is what the watchdog reads;
a stall is declared after the (adaptive) timeout and not before; the culprit is the frozen process,
else the working one that others wait for; stacks come from py-spy, or from the process's own
faulthandler, also for a process stopped with SIGSTOP."""

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prime_rl import activity
from prime_rl.rl import watchdog
from prime_rl.rl.watchdog import Stall, Watchdog, blame, write_stacks

SPEAKER = textwrap.dedent(
    """
    import sys, time
    from prime_rl import activity
    activity.start(sys.argv[2], sys.argv[3], sys.argv[1])
    activity.doing(sys.argv[4], sys.argv[5], int(sys.argv[6]))
    print("ready", flush=True)

    def frozen_here():
        while True:
            time.sleep(0.05)

    frozen_here()
    """
)


@pytest.fixture
def speakers(tmp_path):
    """Start processes that keep a record (label, kind, doing, waits_on, step) and then idle in
    `frozen_here`; all are killed at the end."""
    procs = []

    def start(label: str, kind: str, doing: str, waits_on: str = "", step: int = 0) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", SPEAKER, str(tmp_path), label, kind, doing, waits_on, str(step)],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        procs.append(proc)
        assert proc.stdout.readline().strip() == "ready"
        return proc

    yield start
    for p in procs:
        p.kill()
        p.wait()


def stop(pid: int) -> None:
    """SIGSTOP `pid` and wait until it is stopped (the signal takes effect asynchronously)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 30
    while activity.process_state(pid) != "T":
        assert time.monotonic() < deadline, activity.process_state(pid)
        time.sleep(0.01)


def state(label, kind, waits_on="", since=0.0, beat=None, pid=None) -> activity.State:
    now = time.time()
    return activity.State(label, kind, pid or os.getpid(), "host", 0, f"{label} doing", waits_on, 0, since,
                          now if beat is None else beat, 0.0, Path("/nonexistent"))  # fmt: skip


def test_a_record_says_what_its_process_said_and_its_heartbeat_moves(speakers, tmp_path):
    proc = speakers("trainer-rank0", "trainer", "waiting for the micro-batches of step 9", "orchestrator", 9)
    (s,) = activity.read_all(tmp_path / "activity")
    assert (s.label, s.kind, s.pid, s.doing, s.waits_on, s.step) == (
        "trainer-rank0", "trainer", proc.pid, "waiting for the micro-batches of step 9", "orchestrator", 9,
    )  # fmt: skip
    first = s.beat
    deadline = time.monotonic() + 30
    while activity.read(s.path).beat == first:
        assert time.monotonic() < deadline, "the heartbeat did not move"
        time.sleep(0.1)
    assert s.loop_beat == 0.0  # no event loop in this process


def test_without_start_saying_what_a_process_does_is_a_no_op(monkeypatch):
    monkeypatch.setattr(activity, "_record", None)  # (a test before may have run a trainer here)
    activity.doing("anything", "trainer", 3)  # no record: nothing happens, nothing raises
    assert activity.now() == ""


def test_the_culprit_is_the_frozen_process_else_the_working_one_the_others_wait_for():
    trainer = state("trainer-rank0", "trainer", waits_on="orchestrator", since=1.0)
    orch = state("orchestrator", "orchestrator", waits_on="inference", since=2.0)
    server = state("inference", "inference", since=3.0)
    idle_env = state("env-worker-0", "env-worker", since=0.5)  # works, but nobody waits on env workers
    culprit, why = blame([trainer, orch, server, idle_env], time.time())
    assert culprit is server and why.startswith("stuck")
    frozen_orch = state("orchestrator", "orchestrator", waits_on="inference", beat=time.time() - 100)
    culprit, why = blame([trainer, frozen_orch, server], time.time())
    assert culprit is frozen_orch and why.startswith("frozen (no heartbeat for")
    # Everybody waits on someone (a lost message): the oldest state.
    waiting = [trainer, orch, state("inference", "inference", waits_on="orchestrator", since=3.0)]
    assert blame(waiting, time.time())[0] is trainer


def test_a_process_stopped_with_sigstop_is_frozen_whatever_its_heartbeat(speakers):
    proc = speakers("inference", "inference", "generating, 3 request(s)")
    stop(proc.pid)
    stopped = state("inference", "inference", pid=proc.pid)  # a fresh heartbeat
    working = state("orchestrator", "orchestrator", since=0.0)
    assert blame([working, stopped], time.time()) == (stopped, "frozen (stopped by a signal)")


def test_a_stall_is_declared_after_the_adaptive_timeout_and_not_before(speakers, tmp_path):
    trainer = speakers(
        "trainer-rank0", "trainer", "waiting for the micro-batches of step 0", "orchestrator", 0
    )
    dog = Watchdog(tmp_path / "activity", timeout_s=None, floor_s=60.0, first_step_s=600.0)
    t0 = time.time()
    assert dog.check(t0) is None
    assert dog.check(t0 + 599) is None  # the first step's timeout
    stall = dog.check(t0 + 601)
    assert stall is not None and stall.culprit.pid == trainer.pid and stall.timeout_s == 600.0
    assert dog.check(t0 + 602) is None  # one verdict per stall

    # Steps of 10 s, then one of 30 s: 5x the slowest = 150 s (above the 60 s floor).
    dog = Watchdog(tmp_path / "activity", timeout_s=None, floor_s=60.0, first_step_s=600.0)
    path = activity.read_all(tmp_path / "activity")[0].path
    rewrite = _rewriter(path, trainer.pid)
    dog.check(t0)
    for step, at in ((1, 10), (2, 20), (3, 50)):
        rewrite(step)
        assert dog.check(t0 + at) is None
    assert dog.stall_timeout_s() == 150.0
    assert dog.check(t0 + 50 + 149) is None
    assert dog.check(t0 + 50 + 151) is not None
    # A fixed timeout overrides the adaptive one; 0 turns the watchdog off.
    assert Watchdog(tmp_path, timeout_s=20.0).stall_timeout_s() == 20.0
    off = Watchdog(tmp_path / "activity", timeout_s=0.0)
    assert off.check(t0) is None and off.check(t0 + 10_000) is None


def _rewriter(path: Path, pid: int):
    """Write a trainer record at `path` as process `pid` would (its state moving to `step`)."""

    def rewrite(step: int) -> None:
        record = activity._Record.__new__(activity._Record)
        record.path, record.seq = path, 1000 + 2 * step
        record.fields = {"label": "trainer-rank0", "kind": "trainer", "pid": pid, "host": os.uname().nodename,
                         "started": activity.start_ticks(pid),
                         "doing": f"step {step}: training", "waits_on": "", "step": step, "since": time.time()}  # fmt: skip
        import mmap
        import threading

        with path.open("r+b") as f:
            record.map = mmap.mmap(f.fileno(), activity.SIZE)
        record.lock = threading.Lock()
        record._write_state()
        record.beat(8)

    return rewrite


@pytest.mark.parametrize("tool", ["py-spy", "faulthandler"])
def test_the_stack_file_holds_the_frozen_frame_of_a_stopped_process(speakers, tmp_path, monkeypatch, tool):
    if tool == "faulthandler":
        monkeypatch.setattr(watchdog, "py_spy", lambda: None)
    else:
        assert watchdog.py_spy() is not None, "py-spy is a dependency of the project"
    proc = speakers("trainer-rank0", "trainer", "step 6: training")
    other = speakers(
        "orchestrator", "orchestrator", "step 7: waiting for the trainer's weights of step 6", "trainer"
    )
    stop(proc.pid)
    states = activity.read_all(tmp_path / "activity")
    culprit = next(s for s in states if s.pid == proc.pid)
    stall = Stall(culprit, "frozen (stopped by a signal)", 61.0, 60.0, 6)
    path = tmp_path / "logs" / "stall_6.txt"
    write_stacks(path, stall, states, {}, resume_stopped=True)
    text = path.read_text()
    assert text.startswith("stall: no progress for 61 s")
    culprit_part, rest = text.split(f"=== orchestrator (pid {other.pid}) ===")
    assert f"=== trainer-rank0 (pid {proc.pid}) [culprit] ===" in culprit_part
    assert "frozen_here" in culprit_part, text  # the frame the process was stopped in
    assert "frozen_here" in rest  # every process's stack, not only the culprit's


def test_the_standalone_watchdog_names_a_frozen_process_writes_its_stack_and_kills_it(speakers, tmp_path):
    """`watchdog` for processes started by hand: the same verdict and stack file; `--kill` kills it."""
    frozen = speakers("trainer-rank0", "trainer", "step 3: training", "", 3)
    speakers(
        "orchestrator", "orchestrator", "step 4: waiting for the trainer's weights of step 3", "trainer", 4
    )
    stop(frozen.pid)
    cmd = [str(Path(sys.executable).parent / "watchdog"), "--output_dir", str(tmp_path), "--stall_timeout_s", "1",
           "--kill", "--poll_s", "0.2"]  # fmt: skip
    dog = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert frozen.wait(timeout=60) == -signal.SIGKILL
    finally:
        dog.terminate()
    out = dog.communicate(timeout=30)[0]
    (line,) = [x for x in out.splitlines() if x.startswith("watchdog: stall:")]
    assert f'trainer-rank0 (pid {frozen.pid}) is frozen (stopped by a signal), in "step 3: training"' in line
    (stacks,) = (tmp_path / "logs").glob("stall_3_*.txt")
    assert "frozen_here" in stacks.read_text() and str(stacks) in line
    assert f"watchdog: killed trainer-rank0 (pid {frozen.pid})" in out


def test_a_long_wait_is_one_line_saying_what_every_process_does():
    line = watchdog.waiting_line(
        [
            state("trainer-rank0", "trainer", since=time.time()),
            state("orchestrator", "orchestrator", "trainer"),
        ],
        42,
    )
    assert line.startswith(
        'rl: nothing moved for 42 s: orchestrator "orchestrator doing" (waiting for the trainer)'
    )
    assert 'trainer-rank0 "trainer-rank0 doing" (waiting for nobody)' in line


def test_a_record_of_a_process_that_is_gone_is_not_taken_for_a_process_with_its_pid(speakers, tmp_path):
    proc = speakers("orchestrator", "orchestrator", "step 1: collecting rollouts", "inference", 1)
    (s,) = activity.read_all(tmp_path / "activity")
    assert s.running() and s.started == activity.start_ticks(proc.pid) > 0
    reused = dataclasses.replace(s, started=s.started - 1)  # the same pid, another process
    assert not reused.running()
    proc.kill()
    proc.wait()
    assert not s.running()
