"""Hangs under `rl`, with the real processes: a process frozen with SIGSTOP (the shape of a real hang:
its sockets stay open, it answers nothing) is found by the watchdog, named in one console line, its
stack written to logs/stall_<step>_<time>.txt, and killed; `rl` restarts it as after a crash, and
every step is trained exactly once. Without restarts left, `rl` stops with status 1 and the line.
"""

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rl_test import write_config

from prime_rl import activity
from prime_rl.monitor import read_metrics

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


def run_with_freeze(tmp_path: Path, model: Path, kind: str, steps: int, restarts: int, *flags: str):
    """`rl` on reverse-text; once the trainer has done 3 steps, freeze a `kind` process. Returns
    (rl's exit status, its console, the frozen state, seconds from the freeze to rl's exit or to the
    trainer's next step after the stall line, whichever the caller needs: both are returned)."""
    extra = (
        f"[trainer.ckpt]\ninterval = 2\n[deployment]\nmax_restarts = {restarts}\nrestart_backoff_s = 0.5\n"
    )
    extra += f"stall_floor_s = {FLOOR_S}\n"
    toml = write_config(tmp_path, model, "reverse-text", steps=steps, extra=extra)
    run = tmp_path / "run"
    console = tmp_path / "rl.console"
    with console.open("w") as out:
        proc = subprocess.Popen([RL, "@", str(toml), *flags], stdout=out, stderr=subprocess.STDOUT)
    frozen, healed_s = None, None
    try:
        deadline = time.monotonic() + 600
        while len(trainer_steps(run)) < 3:
            assert proc.poll() is None, console.read_text()[-3000:]
            assert time.monotonic() < deadline, "no 3 trainer steps in 600 s"
            time.sleep(0.2)
        frozen = freeze(run, kind)
        t_freeze, done_at = time.monotonic(), len(trainer_steps(run))
        while proc.poll() is None:
            # Healed: a stall was declared and the trainer did two more steps (trained past the freeze).
            if (
                healed_s is None
                and "rl: stall:" in console.read_text()
                and len(trainer_steps(run)) > done_at + 1
            ):
                healed_s = time.monotonic() - t_freeze
            assert time.monotonic() - t_freeze < 600, console.read_text()[-3000:]
            time.sleep(0.2)
        exit_s = time.monotonic() - t_freeze
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
        if frozen is not None:  # a frozen process that rl did not kill must not outlive the test
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if kind == "inference":
                    os.killpg(os.getpgid(frozen.pid), signal.SIGKILL)
                else:
                    os.kill(frozen.pid, signal.SIGKILL)
    return proc.returncode, console.read_text(), frozen, healed_s, exit_s


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


@pytest.mark.parametrize("kind", ["trainer", "inference", "orchestrator", "env-worker"])
def test_a_frozen_process_is_named_its_stack_written_and_it_is_restarted(tiny_model, tmp_path, kind):
    steps = 8
    flags = ("--orchestrator.env-workers", "1") if kind == "env-worker" else ()
    code, console, frozen, healed_s, _ = run_with_freeze(tmp_path, tiny_model, kind, steps, 2, *flags)
    assert code == 0, console[-3000:]
    lines = stall_lines(console)
    assert len(lines) == 1, console[-3000:]  # one line per stall
    line = lines[0]
    assert f"{frozen.label} (pid {frozen.pid}) is frozen (stopped by a signal)" in line, line
    timeout_s = float(re.search(r"stall timeout (\d+) s", line).group(1))
    assert FLOOR_S <= timeout_s <= 120, line
    stack_file = Path(re.search(r"stacks in (\S+)$", line).group(1))
    assert stack_file.parent == tmp_path / "run" / "logs" and stack_file.name.startswith("stall_")
    section = culprit_section(stack_file, frozen.label)
    assert "[culprit]" in section and "process state T" in section, section[:2000]
    assert re.search(LAST_FRAMES[kind], section), section[:3000]
    # Healed within the stall timeout plus the restart: the trainer went on past the freeze.
    assert healed_s is not None and healed_s < timeout_s + 240, (healed_s, console[-3000:])
    run = tmp_path / "run"
    assert trainer_steps(run) == list(range(steps)), console[-3000:]  # every step exactly once
    orch = read_metrics(run / "orchestrator" / "metrics.jsonl")
    assert [m["step"] for m in orch] == list(range(steps))
    last = orch[-1]
    pending = last["rollouts/all/inflight"] + last["rollouts/all/waiting"]
    buckets = sum(last[f"rollouts/all/{b}_total"] for b in ("trained", "filtered", "failed", "stale"))
    assert last["rollouts/all/dispatched_total"] == buckets + pending
    if kind == "env-worker":  # killed alone; the orchestrator put another in its place
        assert "env worker 0 exited with status -9" in (run / "logs" / "orchestrator.log").read_text()
    else:
        assert f"rl: {frozen.label.split('-rank')[0]} hung and was killed; restarting it" in console


def test_without_restarts_a_frozen_trainer_stops_the_run_with_status_1_and_the_line(tiny_model, tmp_path):
    code, console, frozen, _, exit_s = run_with_freeze(tmp_path, tiny_model, "trainer", 20, 0)
    assert code == 1, console[-3000:]
    lines = stall_lines(console)
    assert len(lines) == 1 and f"{frozen.label} (pid {frozen.pid}) is frozen" in lines[0], console[-3000:]
    timeout_s = float(re.search(r"stall timeout (\d+) s", lines[0]).group(1))
    assert exit_s < timeout_s + 30, (exit_s, lines[0])
    assert "rl: trainer hung and was killed; stopping the others" in console


def test_two_trainer_ranks_one_frozen_mid_run_the_other_gives_up_and_rl_restarts_the_trainer(
    tiny_model, tmp_path
):
    """One rank of two (gloo) SIGSTOPped: the other stops within `trainer.dist_timeout_s` with one line
    naming the collective and the step; under `rl` the trainer (both ranks) restarts and resumes."""
    steps = 8
    flags = ("--deployment.trainer-ranks", "2", "--trainer.dist-timeout-s", "10")
    code, console, frozen, _, _ = run_with_freeze(tmp_path, tiny_model, "trainer-rank1", steps, 2, *flags)
    assert code == 0, console[-3000:]
    assert frozen.label == "trainer-rank1"
    run = tmp_path / "run"
    log = (run / "logs" / "trainer.log").read_text()
    gave_up = [
        line for line in log.splitlines() if "did not complete within trainer.dist_timeout_s = 10 s" in line
    ]
    assert gave_up and "rank 0, step " in gave_up[0], log[-3000:]
    assert "rl: trainer" in console and "restarting it (1 of 2)" in console, console[-3000:]
    assert trainer_steps(run) == list(range(steps)), console[-3000:]
