"""`deployment.max_restarts`: `rl`'s watch loop restarts a child that dies, with back-off, records
each restart (console line, restarts.jsonl), restarts the orchestrator with the trainer, stops at the
limit, and never retries exit status 2. The children here are small Python processes; the chaos test
with the real processes is `tests/integration/fault_test.py`."""

import json
import subprocess
import sys
from pathlib import Path

from prime_rl.launcher.child import Child
from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.supervisor import Launcher
from prime_rl.runtime.layout import restart_counts


def child(launcher: Launcher, name: str, code: str, group: str = "") -> Child:
    """A child running `code`, restartable (each start runs `code` again)."""

    def spawn():
        return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)

    c = Child(name, spawn(), launcher.out / f"{name}.log", group, spawn)
    launcher.children.append(c)
    return c


def starts(counter: Path) -> str:
    """Python that appends to `counter` and leaves the number of earlier starts in `n`."""
    return f"import os, signal, time, pathlib; p = pathlib.Path({str(counter)!r}); n = len(p.read_text()) if p.exists() else 0; p.write_text('x' * (n + 1)); "


def launcher(tmp_path: Path, restarts: int) -> Launcher:
    return Launcher(
        RLConfig(output_dir=tmp_path, deployment={"max_restarts": restarts, "restart_backoff_s": 0.05})
    )


def test_a_killed_trainer_is_restarted_with_its_orchestrator_and_the_restart_recorded(tmp_path, capsys):
    rl = launcher(tmp_path, restarts=2)
    server = child(rl, "inference", "import time; time.sleep(600)")
    # The trainer is SIGKILLed in its first life (once the orchestrator runs) and finishes in its second.
    wait = f"while not pathlib.Path({str(tmp_path / 'o')!r}).exists(): time.sleep(0.01)\n"
    trainer = child(
        rl, "trainer", starts(tmp_path / "t") + "\n" + wait + "n or os.kill(os.getpid(), signal.SIGKILL)"
    )
    orchestrator = child(rl, "orchestrator", starts(tmp_path / "o") + "time.sleep(1)")
    assert rl.watch([server], [trainer, orchestrator], poll_s=0.05) == 0
    assert (tmp_path / "t").read_text() == "xx" and (tmp_path / "o").read_text() == "xx"
    records = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert [(r["process"], r["status"], r["restart"]) for r in records] == [("trainer", -9, 1)]
    assert restart_counts(tmp_path) == {"trainer": 1}
    err = capsys.readouterr().err
    assert (
        "rl: trainer exited with status -9; restarting it (1 of 2)" in err and "with the orchestrator" in err
    )
    assert server.proc.poll() is not None  # the run ended: the server was stopped


def test_a_dead_server_is_restarted_and_the_run_goes_on_and_its_new_life_stops_on_sigterm(tmp_path):
    rl = launcher(tmp_path, restarts=1)
    rl.grace_s = 30  # a restarted server that did not take SIGTERM would hold the test here
    # It exits 0 in its first life, as vLLM's API server does when its engine dies: still a failure.
    # In its second it says that SIGTERM reached it: a child inherits its parent's blocked signals,
    # and rl had blocked them while it started a child again.
    term = tmp_path / "term"
    on_term = f"signal.signal(signal.SIGTERM, lambda *_: (pathlib.Path({str(term)!r}).touch(), os._exit(0)))"
    server = child(rl, "inference", starts(tmp_path / "s") + f"n or os._exit(0); {on_term}; time.sleep(600)")
    worker = child(rl, "trainer", "import time, pathlib, sys; p = pathlib.Path(sys.argv[0]); time.sleep(1.5)")
    assert rl.watch([server], [worker], poll_s=0.05) == 0
    assert (tmp_path / "s").read_text() == "xx"
    assert restart_counts(tmp_path) == {"inference": 1}
    assert term.exists()


def test_restarts_stop_at_the_limit_and_exit_status_2_is_never_retried(tmp_path, capsys):
    rl = launcher(tmp_path / "a", restarts=2)
    crashing = child(rl, "orchestrator", starts(tmp_path / "c") + "os._exit(1)")
    assert rl.watch([], [crashing], poll_s=0.05) == 1
    assert (tmp_path / "c").read_text() == "xxx"  # the first life and 2 restarts
    assert restart_counts(tmp_path / "a") == {"orchestrator": 2}

    rl = launcher(tmp_path / "b", restarts=5)
    user_error = child(rl, "orchestrator", starts(tmp_path / "u") + "os._exit(2)")
    assert rl.watch([], [user_error], poll_s=0.05) == 2
    assert (tmp_path / "u").read_text() == "x" and restart_counts(tmp_path / "b") == {}
    assert "rl: orchestrator exited with status 2; stopping the others" in capsys.readouterr().err


def test_without_max_restarts_the_first_death_stops_the_run(tmp_path):
    rl = launcher(tmp_path, restarts=0)
    server = child(rl, "inference", "import time; time.sleep(600)")
    trainer = child(rl, "trainer", starts(tmp_path / "t") + "os._exit(1)")
    assert rl.watch([server], [trainer], poll_s=0.05) == 1
    assert (tmp_path / "t").read_text() == "x" and not (tmp_path / "restarts.jsonl").exists()
