"""The activity records and the watchdog's verdicts: what a process says is what the watchdog reads;
a stall is declared after the (adaptive) timeout and not before; the culprit is the frozen process,
else the working one that others wait for; stacks come from py-spy, or from the process's own
faulthandler, also for a process stopped with SIGSTOP."""

import dataclasses
import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from prime_rl.launcher import watchdog
from prime_rl.launcher.watchdog import Stall, Watchdog, blame, write_stacks
from prime_rl.runtime import activity

SPEAKER = textwrap.dedent(
    """
    import sys, time
    from prime_rl.runtime import activity
    activity.start(sys.argv[2], sys.argv[3], sys.argv[1])
    activity.doing(sys.argv[4], sys.argv[5], int(sys.argv[6]))

    def frozen_here():
        # Said from in here: once the test reads it, this frame is on the stack (said before the
        # call, a stack taken at once could still show the module's line).
        print("ready", flush=True)
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
    deadline = time.monotonic() + 60
    while activity.process_state(pid) != "T":
        assert time.monotonic() < deadline, activity.process_state(pid)
        time.sleep(0.01)


def state(label, kind, waits_on="", since=0.0, beat=None, pid=None) -> activity.State:
    now = time.time()
    return activity.State(label, kind, pid or os.getpid(), "host", 0, f"{label} doing", waits_on, 0, since, False,
                          0, now if beat is None else beat, 0.0, Path("/nonexistent"))  # fmt: skip


def test_a_record_says_what_its_process_said_and_its_heartbeat_moves(speakers, tmp_path):
    proc = speakers("trainer-rank0", "trainer", "waiting for the micro-batches of step 9", "orchestrator", 9)
    (s,) = activity.read_all(tmp_path / "activity")
    assert (s.label, s.kind, s.pid, s.doing, s.waits_on, s.step) == (
        "trainer-rank0", "trainer", proc.pid, "waiting for the micro-batches of step 9", "orchestrator", 9,
    )  # fmt: skip
    first = s.beat
    deadline = time.monotonic() + 60
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
    # Everybody waits on someone (a lost message): the oldest state of the cycle, not the trainer.
    waiting = [trainer, orch, state("inference", "inference", waits_on="orchestrator", since=3.0)]
    assert blame(waiting, time.time()) == (orch, "waiting in a cycle (every process here waits for another)")
    # ... or for a kind that is not here: no verdict (another machine's watchdog has it).
    assert blame([trainer], time.time()) is None


def test_a_process_stopped_with_sigstop_is_frozen_whatever_its_heartbeat(speakers):
    proc = speakers("inference", "inference", "generating, 3 request(s)")
    stop(proc.pid)
    stopped = state("inference", "inference", pid=proc.pid)  # a fresh heartbeat
    working = state("orchestrator", "orchestrator", since=0.0)
    assert blame([working, stopped], time.time()) == (stopped, "frozen (stopped by a signal)")


@pytest.fixture
def sleepers():
    """Live processes that keep no record themselves: the tests write their records (`fake`), with
    heartbeats at the times the test chooses."""
    procs = []

    def start() -> int:
        procs.append(subprocess.Popen(["sleep", "1000"]))
        return procs[-1].pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def fake(folder: Path, pid: int, label: str, kind: str, doing: str, waits_on: str = "", step: int = 0,
         at: float = 0.0, io: bool = False, beat: float | None = None, step_s: float = 0.0) -> None:  # fmt: skip
    """Write `pid`'s record as its process would: its state begun at time `at`, its heartbeat at
    `beat` (default: `at`), its last whole step `step_s` long."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{label}.{pid}"
    if not path.exists():
        path.write_bytes(bytes(activity.SIZE))
    body = json.dumps({"label": label, "kind": kind, "pid": pid, "host": "h", "started": activity.start_ticks(pid),
                       "doing": doing, "waits_on": waits_on, "step": step, "since": at, "io": io,
                       "progress": 0, "step_s": step_s}).encode()  # fmt: skip
    data = bytearray(path.read_bytes())
    seq = struct.unpack("<Q", data[:8])[0] + 2
    data[: activity.HEADER.size] = activity.HEADER.pack(seq, at if beat is None else beat, 0.0, len(body))
    data[activity.HEADER.size : activity.HEADER.size + len(body)] = body
    path.write_bytes(bytes(data))


def test_a_stall_is_declared_after_the_adaptive_timeout_and_not_before(sleepers, tmp_path):
    folder = tmp_path / "activity"
    trainer, orch = sleepers(), sleepers()
    t0 = time.time()
    fake(folder, trainer, "trainer-rank0", "trainer", "loading the model", at=t0)
    fake(folder, orch, "orchestrator", "orchestrator", "step 0: collecting rollouts", "inference", at=t0)
    dog = Watchdog(folder, timeout_s=None, floor_s=60.0, first_step_s=600.0)
    assert dog.check(t0) is None
    # Steps: start-up, the first step (10 s, which the trainer does not time), then 10 s and 30 s,
    # each said by the trainer at its next step: 5x the slowest = 150 s (above the floor).
    for step, at, took in ((0, 100, 0.0), (1, 110, 0.0), (2, 120, 10.0), (3, 150, 30.0)):
        fake(folder, trainer, "trainer-rank0", "trainer", f"step {step}: training", step=step, at=t0 + at, step_s=took)  # fmt: skip
        fake(
            folder,
            orch,
            "orchestrator",
            "orchestrator",
            f"step {step + 1}: collecting",
            "inference",
            at=t0 + at,
        )
        assert dog.check(t0 + at) is None
    assert dog.stall_timeout_s() == 150.0
    # Heartbeats go on (the processes live), states stand still.
    for at in (299, 301):
        fake(
            folder, trainer, "trainer-rank0", "trainer", "step 3: training", step=3, at=t0 + 150, beat=t0 + at
        )
        fake(
            folder,
            orch,
            "orchestrator",
            "orchestrator",
            "step 4: collecting",
            "inference",
            at=t0 + 150,
            beat=t0 + at,
        )
        stall = dog.check(t0 + at)
        assert (stall is None) == (at == 299)
    assert stall is not None and stall.culprit.pid == trainer and stall.step == 3 and stall.timeout_s == 150.0
    assert dog.check(t0 + 150 + 152) is None  # one verdict per stall, then a first step's timeout


def test_a_trainer_resumed_from_a_checkpoint_times_neither_the_jump_to_its_step_nor_its_first_step(
    sleepers, tmp_path
):
    """A restarted trainer says step 0 while it loads, then the step it resumes at: that jump is no
    step trained, and the first step after it (waiting for the re-sent batches) is not timed either."""
    folder = tmp_path / "activity"
    trainer = sleepers()
    t0 = time.time()
    dog = Watchdog(folder, timeout_s=None, floor_s=10.0, first_step_s=600.0)
    fake(folder, trainer, "trainer-rank0", "trainer", "loading the model and its checkpoint", at=t0, io=True)
    assert dog.check(t0) is None
    # Resumed at step 4 after 5 s of loading; step 4 waits 40 s for its batches (the trainer does not
    # time its first step), then 1 s steps.
    for step, at, took in ((4, 5, 0.0), (5, 45, 0.0), (6, 46, 1.0), (7, 47, 1.0)):
        waiting = f"waiting for the micro-batches of step {step}"
        fake(folder, trainer, "trainer-rank0", "trainer", waiting, "orchestrator", step=step, at=t0 + at, step_s=took)  # fmt: skip
        assert dog.check(t0 + at) is None
        # Publishing the step is file work: the same step, no new one.
        fake(folder, trainer, "trainer-rank0", "trainer", "publishing", step=step, at=t0 + at + 0.5, io=True)
        assert dog.check(t0 + at + 0.5) is None
    assert dog.stall_timeout_s() == 10.0  # the floor: 5 x 1 s, not 5 x 40 s


def test_steps_shorter_than_the_polls_are_timed_from_the_trainers_record(sleepers, tmp_path):
    """A tiny model's steps take less than the watchdog's polls are apart: the polls see steps 0 and 3
    only, and the timeout still adapts (from the step times the trainer's record says), where
    timing steps from the polls it would stay the first step's 600 s."""
    folder = tmp_path / "activity"
    trainer = sleepers()
    t0 = time.time()
    dog = Watchdog(folder, timeout_s=None, floor_s=10.0, first_step_s=600.0)
    for step, at, took in ((0, 0.0, 0.0), (3, 1.0, 0.4)):
        fake(folder, trainer, "trainer-rank0", "trainer", f"step {step}: training", step=step, at=t0 + at, step_s=took)  # fmt: skip
        assert dog.check(t0 + at) is None
    assert dog.stall_timeout_s() == 10.0  # the floor: 5 x 0.4 s
    # An orchestrator restart: step 3, in progress, waits 27.5 s for it (not a measure of a step);
    # step 4 is the first whole one.
    dog.restarted(t0 + 1.5)
    assert dog.stall_timeout_s() == 600.0
    for step, at, took in ((3, 2.0, 0.4), (4, 29.5, 27.5), (5, 30.0, 0.5), (6, 30.5, 0.5)):
        fake(folder, trainer, "trainer-rank0", "trainer", f"step {step}: training", step=step, at=t0 + at, step_s=took)  # fmt: skip
        assert dog.check(t0 + at) is None
        assert dog.stall_timeout_s() == {3: 600.0, 4: 600.0, 5: 10.0, 6: 10.0}[step]


def test_before_the_first_step_the_fixed_first_step_timeout_holds_and_a_fixed_one_overrides(
    sleepers, tmp_path
):
    folder = tmp_path / "activity"
    pid = sleepers()
    t0 = time.time()
    fake(folder, pid, "trainer-rank0", "trainer", "loading the model", at=t0)
    dog = Watchdog(folder, timeout_s=None, floor_s=60.0, first_step_s=600.0)
    assert dog.check(t0) is None and dog.check(t0 + 599) is None
    assert dog.check(t0 + 601) is not None
    assert Watchdog(folder, timeout_s=20.0).stall_timeout_s() == 20.0
    off = Watchdog(folder, timeout_s=0.0)  # 0: no watchdog
    assert off.check(t0) is None and off.check(t0 + 10_000) is None


def test_one_process_frozen_for_the_timeout_is_a_stall_while_the_others_go_on(sleepers, tmp_path):
    folder = tmp_path / "activity"
    server, other, orch = sleepers(), sleepers(), sleepers()
    t0 = time.time()
    dog = Watchdog(folder, timeout_s=30.0)
    for at in range(0, 40, 5):  # the orchestrator and one server move; one server's heartbeat stops at 0
        fake(folder, server, "inference", "inference", "generating, 2 request(s)", at=t0)
        fake(folder, other, "inference-1", "inference", f"generating, {at} request(s)", at=t0 + at)
        fake(folder, orch, "orchestrator", "orchestrator", f"step {at}: collecting", "inference", at=t0 + at)
        stall = dog.check(t0 + at)
        assert (stall is None) == (at < 30), at
    assert stall.culprit.pid == server and stall.why.startswith("frozen (no heartbeat for 35 s)")


def test_file_work_is_progress_in_a_state_marked_io(tmp_path, monkeypatch):
    """A trainer writing a checkpoint for longer than the timeout is not hung while it writes."""
    monkeypatch.setattr(watchdog, "frozen", lambda s, now: "")  # (its real heartbeats, simulated time)
    folder = tmp_path / "activity"
    script = textwrap.dedent(
        """
        import sys, time
        from prime_rl.runtime import activity
        activity.start("trainer-rank0", "trainer", sys.argv[1])
        activity.doing("step 5: writing the checkpoint of step 6", "", 5, io=True)
        print("ready", flush=True)
        with open(sys.argv[2], "wb") as f:
            while sys.stdin.readline().strip() == "write":
                f.write(b"x" * 4096)
                f.flush()
                print("wrote", flush=True)
        time.sleep(1000)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path), str(tmp_path / "ckpt")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().strip() == "ready"
        dog = Watchdog(folder, timeout_s=10.0)
        t0 = time.time()
        assert dog.check(t0) is None
        for at in (8, 16, 24):  # past the timeout, but writing
            proc.stdin.write("write\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "wrote"
            assert dog.check(t0 + at) is None, at
        proc.stdin.write("stop\n")
        proc.stdin.flush()
        assert dog.check(t0 + 30) is None  # (what it wrote before counts once more)
        stall = dog.check(t0 + 41)
        assert stall is not None and stall.culprit.pid == proc.pid and stall.why.startswith("stuck")
    finally:
        proc.kill()
        proc.wait()


def test_processes_that_wait_for_a_process_elsewhere_get_no_verdict_here(sleepers, tmp_path):
    """An inference-only node: its idle server waits for an orchestrator on another machine."""
    folder = tmp_path / "activity"
    server = sleepers()
    t0 = time.time()
    fake(folder, server, "inference", "inference", "idle, waiting for requests", "orchestrator", at=t0)
    dog = Watchdog(folder, timeout_s=10.0)
    assert dog.check(t0) is None
    fake(folder, server, "inference", "inference", "idle, waiting for requests", "orchestrator", at=t0 + 11)
    assert dog.check(t0 + 11) is None


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
    # Which tool wrote it: py-spy's header, or faulthandler's frame lines.
    written_by = f"Process {proc.pid}:" if tool == "py-spy" else 'File "<string>", line'
    assert written_by in culprit_part, culprit_part


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
    line = next(x for x in out.splitlines() if x.startswith("watchdog: stall:"))
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


def test_a_process_that_dies_of_a_fatal_signal_writes_every_threads_stack_to_its_stderr(tmp_path):
    """A native crash (here an abort, as glibc's heap checks raise) names where each thread was: the
    record's start enables faulthandler on the process's stderr (its log under `rl`)."""
    code = textwrap.dedent(
        """
        import os, sys, threading, time
        from prime_rl.runtime import activity
        activity.start("trainer-rank0", "trainer", sys.argv[1])

        def writing_in_the_background():
            time.sleep(60)

        threading.Thread(target=writing_in_the_background, daemon=True).start()

        def crashing_here():
            os.abort()

        crashing_here()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -signal.SIGABRT
    assert "Fatal Python error: Aborted" in proc.stderr, proc.stderr
    assert "in crashing_here" in proc.stderr and "in writing_in_the_background" in proc.stderr, proc.stderr
