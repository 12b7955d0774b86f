"""Hangs under `rl`, with the real processes: a process frozen with SIGSTOP (the shape of a real hang:
its sockets stay open, it answers nothing) is found by the watchdog, named in one console line, its
stack written to logs/stall_<step>_<time>.txt, and killed; `rl` restarts it as after a crash, and
every step is trained exactly once. Without restarts left, `rl` stops with status 1 and the line.
"""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from rl_test import write_config

from prime_rl.runtime import activity
from prime_rl.runtime.monitor import read_metrics

pytestmark = pytest.mark.slow

RL = str(Path(sys.executable).parent / "rl")
FLOOR_S = 15
"""The adaptive stall timeout's floor in these runs (5x the slowest step is ~20-30 s here)."""


def trainer_steps(run: Path) -> list[int]:
    path = run / "trainer" / "metrics.jsonl"
    return [m["step"] for m in read_metrics(path)] if path.exists() else []


def freeze(run: Path, kind: str) -> activity.State:
    """SIGSTOP the live process of `kind`, or with that label (a server: its whole process group, engine
    included)."""
    states = activity.read_all(run / "activity")
    target = next(s for s in states if kind in (s.kind, s.label) and s.running())
    if kind == "inference":
        os.killpg(os.getpgid(target.pid), signal.SIGSTOP)
    else:
        os.kill(target.pid, signal.SIGSTOP)
    return target


@dataclass
class Freeze:
    """One process frozen during a run, and what followed."""

    state: activity.State
    lines: list[str]
    """The stall lines `rl` printed between this freeze and the next (or the end)."""
    healed_s: float | None
    """Seconds from the freeze to a stall line and two more trainer steps; None if the run never got there."""


def run_with_freezes(tmp_path: Path, model: Path, kinds: list[str], steps: int, restarts: int, *flags: str):
    """`rl` on reverse-text, freezing a process of each of `kinds` in turn: the first once the trainer
    has done 3 steps, each next one once the run healed from the one before and the trainer did 2 more
    steps (so the watchdog has timed a step again and uses its adaptive timeout, not the first step's:
    healed is 2 steps after the restart, and the first after one is not timed).
    Returns (rl's exit status, its console, a `Freeze` per kind, seconds from the last freeze to exit)."""
    extra = (
        f"[trainer.ckpt]\ninterval = 2\n[deployment]\nmax_restarts = {restarts}\nrestart_backoff_s = 0.5\n"
    )
    # The first step's timeout stays the default (600 s): a freeze is declared within the adaptive one
    # (the test checks), which needs the trainer's own step times (its steps here are shorter than
    # the watchdog's polls are apart).
    extra += f"stall_floor_s = {FLOOR_S}\n"
    toml = write_config(tmp_path, model, "reverse-text", steps=steps, extra=extra)
    run = tmp_path / "run"
    console = tmp_path / "rl.console"
    with console.open("w") as out:
        proc = subprocess.Popen([RL, "@", str(toml), *flags], stdout=out, stderr=subprocess.STDOUT)
    freezes: list[Freeze] = []
    frozen: list[tuple[str, int]] = []
    try:
        deadline, wait_for = time.monotonic() + 600, 3
        for kind in kinds:
            while len(trainer_steps(run)) < wait_for:
                assert proc.poll() is None, console.read_text()[-3000:]
                assert time.monotonic() < deadline, f"no {wait_for} trainer steps in 600 s"
                time.sleep(0.2)
            seen = len(stall_lines(console.read_text()))
            state = freeze(run, kind)
            frozen.append((kind, state.pid))
            t_freeze, done_at, healed_s = time.monotonic(), len(trainer_steps(run)), None
            deadline = t_freeze + 600  # a hang guard: the tests bound healed_s themselves
            # Healed: a stall was declared and the trainer did two more steps (trained past the freeze).
            while proc.poll() is None and healed_s is None:
                if len(stall_lines(console.read_text())) > seen and len(trainer_steps(run)) > done_at + 1:
                    healed_s = time.monotonic() - t_freeze
                assert time.monotonic() < deadline, console.read_text()[-3000:]
                time.sleep(0.2)
            freezes.append(Freeze(state, [], healed_s))
            deadline, wait_for = time.monotonic() + 600, len(trainer_steps(run)) + 2
        proc.wait(timeout=600)
        exit_s = time.monotonic() - t_freeze
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
        for kind, pid in frozen:  # a frozen process that rl did not kill must not outlive the test
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if kind == "inference":
                    os.killpg(os.getpgid(pid), signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
    text = console.read_text()
    lines = stall_lines(text)
    # Each stall line is the one of the first freeze whose process it names.
    for f in freezes:
        f.lines = [line for line in lines if f"(pid {f.state.pid})" in line]
    return proc.returncode, text, freezes, exit_s


def stall_lines(console: str) -> list[str]:
    return [line for line in console.splitlines() if line.startswith("rl: stall:")]


def culprit_section(stack_file: Path, label: str) -> str:
    text = stack_file.read_text()
    start = text.index(f"=== {label} (pid")
    end = text.find("\n=== ", start + 1)
    return text[start : end if end > 0 else None]


# The frame each frozen process is expected to be in, in its own stack: py-spy's `function (file:line)`
# or, where py-spy cannot attach, faulthandler's `File "file", line N in function`.
LAST_FRAMES = {
    "trainer": r"train \(prime_rl/trainer/main\.py:\d+\)|trainer/main\.py\", line \d+ in train\b",
    "orchestrator": r"prime_rl/orchestrator/main\.py[:\"]",
    "inference": r"prime_rl/inference/vllm_server\.py[:\"]",
    "env-worker": r"prime_rl/orchestrator/envs/worker\.py[:\"]",
}


KINDS = ["trainer", "env-worker", "orchestrator", "inference"]
STEPS = 26
"""Enough for four freezes, each healed (2 steps after it) with 2 steps between them: 17 steps, and
25 if every wait overshoots by a step (the polls are 0.2 s apart, a step takes a second or more)."""


@pytest.fixture(scope="module")
def four_freezes(tiny_model, tmp_path_factory):
    """One run (one env worker) in which a process of each kind is frozen in turn: the four tests below
    read it, so it costs one `rl` start instead of four."""
    tmp = tmp_path_factory.mktemp("freezes")
    code, console, freezes, _ = run_with_freezes(
        tmp, tiny_model, KINDS, STEPS, len(KINDS), "--orchestrator.env-workers", "1"
    )
    return tmp / "run", code, console, dict(zip(KINDS, freezes, strict=True))


@pytest.mark.xdist_group("four_freezes")
@pytest.mark.parametrize("kind", KINDS)
def test_a_frozen_process_is_named_its_stack_written_and_it_is_restarted(four_freezes, kind):
    run, code, console, freezes = four_freezes
    assert code == 0, console[-3000:]
    assert len(stall_lines(console)) == len(KINDS), console[-3000:]  # one line per stall
    frozen = freezes[kind].state
    assert len(freezes[kind].lines) == 1, console[-3000:]
    line = freezes[kind].lines[0]
    assert f"{frozen.label} (pid {frozen.pid}) is frozen (stopped by a signal)" in line, line
    timeout_s = float(re.search(r"stall timeout (\d+) s", line).group(1))
    assert FLOOR_S <= timeout_s <= 120, line
    stack_file = Path(re.search(r"stacks in (\S+)$", line).group(1))
    assert stack_file.parent == run / "logs" and stack_file.name.startswith("stall_")
    section = culprit_section(stack_file, frozen.label)
    assert "[culprit]" in section and "process state T" in section, section[:2000]
    assert re.search(LAST_FRAMES[kind], section), section[:3000]
    # Healed within the stall timeout plus the restart: the trainer went on past the freeze.
    healed_s = freezes[kind].healed_s
    # wall-clock: healing after the stall timeout (plus a restart's 240 s) is the behaviour under test.
    assert healed_s is not None and healed_s < timeout_s + 240, (healed_s, console[-3000:])
    assert trainer_steps(run) == list(range(STEPS)), console[-3000:]  # every step exactly once
    orch = read_metrics(run / "orchestrator" / "metrics.jsonl")
    assert [m["step"] for m in orch] == list(range(STEPS))
    last = orch[-1]
    pending = last["rollouts/all/inflight"] + last["rollouts/all/waiting"]
    buckets = sum(last[f"rollouts/all/{b}_total"] for b in ("trained", "filtered", "failed", "stale"))
    assert last["rollouts/all/dispatched_total"] == buckets + pending
    if kind == "env-worker":  # killed alone; the orchestrator put another in its place
        assert "env worker 0 exited with status -9" in (run / "logs" / "orchestrator.log").read_text()
    else:
        assert f"rl: {frozen.label.split('-rank')[0]} hung and was killed; restarting it" in console


def test_without_restarts_a_frozen_trainer_stops_the_run_with_status_1_and_the_line(tiny_model, tmp_path):
    code, console, (freeze,), exit_s = run_with_freezes(tmp_path, tiny_model, ["trainer"], 20, 0)
    assert code == 1, console[-3000:]
    lines = stall_lines(console)
    assert len(lines) == 1 and f"{freeze.state.label} (pid {freeze.state.pid}) is frozen" in lines[0], (
        console[-3000:]
    )
    timeout_s = float(re.search(r"stall timeout (\d+) s", lines[0]).group(1))
    # wall-clock: stopping after the stall timeout is the behaviour under test; several times it,
    # plus the others' stop on a loaded machine.
    assert exit_s < 3 * timeout_s + 60, (exit_s, lines[0])
    assert "rl: trainer hung and was killed; stopping the others" in console


def test_two_trainer_ranks_one_frozen_mid_run_the_other_gives_up_and_rl_restarts_the_trainer(
    tiny_model, tmp_path
):
    """One rank of two (gloo) SIGSTOPped: the other stops within `trainer.dist_timeout_s` with one line
    naming the collective and the step; under `rl` the trainer (both ranks) restarts and resumes."""
    steps = 8
    flags = ("--deployment.trainer-ranks", "2", "--trainer.dist-timeout-s", "10")
    code, console, (freeze,), _ = run_with_freezes(tmp_path, tiny_model, ["trainer-rank1"], steps, 2, *flags)
    assert code == 0, console[-3000:]
    assert freeze.state.label == "trainer-rank1"
    run = tmp_path / "run"
    log = (run / "logs" / "trainer.log").read_text()
    gave_up = [
        line for line in log.splitlines() if "did not complete within trainer.dist_timeout_s = 10 s" in line
    ]
    assert gave_up and "rank 0, step " in gave_up[0], log[-3000:]
    assert "rl: trainer" in console and "restarting it (1 of 2)" in console, console[-3000:]
    assert trainer_steps(run) == list(range(steps)), console[-3000:]


def engine_core(run: Path, other_than: int = 0) -> activity.State:
    """The live record of vLLM's engine core in the orchestrator (engine mode), waiting for a new one
    that is generating: frozen or killed then, it has requests in flight, which its end fails (idle,
    it lost none: the orchestrator waits for the trainer most of a tiny model's step)."""
    deadline = time.monotonic() + 300
    while True:
        for s in activity.read_all(run / "activity"):
            if (
                s.label == activity.ENGINE_CORE
                and s.running()
                and s.pid != other_than
                and s.doing == "generating"
            ):
                return s
        assert time.monotonic() < deadline, "no engine core record"
        time.sleep(0.2)


def test_in_engine_mode_a_frozen_then_a_killed_engine_core_is_restarted_and_every_step_trains_once(
    tiny_model, tmp_path
):
    """Engine mode, `rl`'s default on one machine: the engine core (a child of the orchestrator) is
    frozen, then, once the run healed, killed. The frozen one is named in one stall line with its
    stack; each time the orchestrator restarts its engine alone (no orchestrator restart), the groups
    on it go again, and only our lines reach the console (none of vLLM's tracebacks)."""
    steps = 14
    extra = (
        '[deployment]\ninference_mode = "engine"\nmax_restarts = 3\nrestart_backoff_s = 0.5\n'
        f"stall_floor_s = {FLOOR_S}\n"
    )
    toml = write_config(tmp_path, tiny_model, "reverse-text", steps=steps, extra=extra)
    run, console = tmp_path / "run", tmp_path / "rl.console"
    with console.open("w") as out:
        proc = subprocess.Popen([RL, "@", str(toml)], stdout=out, stderr=subprocess.STDOUT)

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 600
        while not condition():
            assert proc.poll() is None, console.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{what}: {console.read_text()[-3000:]}"
            time.sleep(0.2)

    try:
        wait_for(lambda: len(trainer_steps(run)) >= 3, "3 trainer steps")
        frozen = engine_core(run)
        os.kill(frozen.pid, signal.SIGSTOP)
        wait_for(lambda: stall_lines(console.read_text()), "a stall line")
        # The kill must find the restarted engine serving: steps counted from the first restart's
        # line (ones counted from the freeze can be the batches made before it, and the kill then
        # lands on an engine core still starting, which the first restart itself replaces).
        wait_for(lambda: "restarting the engine (1 of 3" in console.read_text(), "the first restart")
        healed_at = len(trainer_steps(run))
        wait_for(lambda: len(trainer_steps(run)) > healed_at + 1, "two steps after the first restart")
        killed = engine_core(run, other_than=frozen.pid)
        os.kill(killed.pid, signal.SIGKILL)
        wait_for(lambda: "restarting the engine (2 of 3" in console.read_text(), "the restart after the kill")
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
        with contextlib.suppress(ProcessLookupError):
            os.kill(frozen.pid, signal.SIGKILL)
    text = console.read_text()
    assert proc.returncode == 0, text[-3000:]
    (line,) = stall_lines(text)
    assert f"{activity.ENGINE_CORE} (pid {frozen.pid}) is frozen (stopped by a signal)" in line, line
    section = culprit_section(Path(re.search(r"stacks in (\S+)$", line).group(1)), activity.ENGINE_CORE)
    assert "[culprit]" in section and "process state T" in section, section[:2000]
    assert re.search(r"vllm/v1/engine/core\.py", section), section[:3000]  # its own stack, vLLM's loop
    assert text.count("restarting the engine (") == 2, text[-3000:]
    assert "restarting the engine (2 of 3, client.max_restarts)" in text
    # Only our lines: vLLM's error records of the dead engine core stay in the orchestrator's log.
    assert "EngineDeadError" not in text and "Traceback" not in text, text[-3000:]
    assert "EngineDeadError" in (run / "logs" / "orchestrator.log").read_text()
    restarts = [json.loads(x) for x in (run / "restarts.jsonl").read_text().splitlines()]
    assert [(r["process"], r["restart"]) for r in restarts] == [("inference", 1), ("inference", 2)]
    assert trainer_steps(run) == list(range(steps)), text[-3000:]  # every step exactly once
    orch = read_metrics(run / "orchestrator" / "metrics.jsonl")
    assert [m["step"] for m in orch] == list(range(steps))
    last = orch[-1]
    assert last["restarts/inference"] == 2
    pending = last["rollouts/all/inflight"] + last["rollouts/all/waiting"]
    buckets = sum(last[f"rollouts/all/{b}_total"] for b in ("trained", "filtered", "failed", "stale"))
    assert last["rollouts/all/dispatched_total"] == buckets + pending
    records = [
        json.loads(x) for p in sorted((run / "rollouts").glob("*.jsonl")) for x in p.read_text().splitlines()
    ]
    lost = {(r["env"], r["example_id"]) for r in records if "Server" in (r.get("error") or "")}
    assert lost, "no rollout was lost with an engine core"
    # Each example lost with an engine core was dispatched again (and trained or filtered).
    used = {(r["env"], r["example_id"]) for r in records if not r.get("error")}
    assert lost <= used, lost - used
