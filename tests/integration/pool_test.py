"""The elastic inference pool under `rl`, with real vLLM servers on loopback: servers join and leave
a running run, the first one is killed, and nothing is lost or trained twice.

One run of 12 steps (server mode, `deployment.max_restarts`), during which a second server started
by hand (`inference --pool.join <run dir>`) joins and receives groups, a third with another secret is
refused in one line on both sides (status 2), the first server is SIGKILLed (`rl` restarts it) and
the second is SIGTERMed and drains (status 0). The orchestrator's SIGKILL and restart are
`fault_test.py`'s; the engine's, `hang_test.py`'s.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rl_test import write_config

from helpers.cores import server_env
from prime_rl.launcher.processes import process_tree
from prime_rl.runtime import activity
from prime_rl.runtime.monitor import read_metrics
from prime_rl.runtime.net import free_port

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
STEPS = 12
"""The events end with the trainer at step 4 or 5 (it is held through each; measured in 6 runs), and
the restarted first server must serve the steps after them."""


def trainer_steps(run: Path) -> list[int]:
    path = run / "trainer" / "metrics.jsonl"
    return [m["step"] for m in read_metrics(path)] if path.exists() else []


def orchestrator_metrics(run: Path) -> list[dict]:
    path = run / "orchestrator" / "metrics.jsonl"
    return read_metrics(path) if path.exists() else []


def start_server(
    tmp: Path, name: str, model: Path, run: Path, secret_file: Path
) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = (tmp / f"{name}.log").open("w")
    cmd = [
        str(BIN / "inference"),
        "--model.name", str(model),
        "--output-dir", str(run),
        "--server.port", str(port),
        "--pool.join", str(run),
        "--pool.drain-s", "60",
    ]  # fmt: skip
    env = {**server_env(), "PRIME_RL_SECRET_FILE": str(secret_file)}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"127.0.0.1:{port}"


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


@pytest.fixture(scope="module")
def elastic_run(tiny_model, tmp_path_factory):
    """The run, with the events in order. The trainer is held (SIGSTOP; the watchdog is off) while a
    server starts and while the first is killed and the second drains, so that the run cannot end
    before they happen, however slow this machine is; the orchestrator meanwhile waits within the
    async level, as it would for a slow trainer."""
    tmp = tmp_path_factory.mktemp("pool")
    extra = "[deployment]\nmax_restarts = 3\nrestart_backoff_s = 0.5\nstall_timeout_s = 0\n"
    toml = write_config(tmp, tiny_model, "reverse-text", steps=STEPS, extra=extra)
    run, console = tmp / "run", tmp / "rl.console"
    with console.open("w") as out:
        rl = subprocess.Popen([str(BIN / "rl"), "@", str(toml)], stdout=out, stderr=subprocess.STDOUT)
    started: list[subprocess.Popen] = []

    def wait_for(condition, what: str, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert rl.poll() is None, f"rl ended while waiting for {what}: {console.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{what}: {console.read_text()[-3000:]}"
            time.sleep(0.2)

    def log() -> str:
        path = run / "logs" / "orchestrator.log"
        return path.read_text() if path.exists() else ""

    def groups_of(name: str) -> int:
        return sum(m.get(f"pool/{name}/groups", 0) for m in orchestrator_metrics(run))

    def trainer(sig: signal.Signals) -> None:
        for s in activity.read_all(run / "activity"):
            if s.kind == "trainer" and s.running():
                os.kill(s.pid, sig)

    facts = {}
    try:
        wait_for(lambda: len(trainer_steps(run)) >= 2, "2 trainer steps")
        trainer(signal.SIGSTOP)
        second, second_name = start_server(tmp, "second", tiny_model, run, run / ".secret")
        wrong = tmp / "wrong.secret"
        wrong.write_text("another-runs-secret-0123456789abcdef\n")
        wrong.chmod(0o600)
        third, _ = start_server(tmp, "third", tiny_model, run, wrong)
        started += [second, third]
        facts["third_status"] = third.wait(timeout=600)
        wait_for(lambda: f"inference server http://{second_name} joined the pool" in log(), "the join")
        trainer(signal.SIGCONT)
        wait_for(lambda: groups_of(second_name) > 0, "the second server to get groups")
        trainer(signal.SIGSTOP)
        # The first server, rl's, is killed (rl restarts it), and the second drains and leaves.
        rl_server = [p for p in process_tree(rl.pid) if b"vllm_server" in cmdline(p)]
        assert rl_server, "rl's server was not found"
        os.killpg(os.getpgid(rl_server[0]), signal.SIGKILL)
        second.send_signal(signal.SIGTERM)
        facts["second_status"] = second.wait(timeout=120)
        facts["left_at"] = len(trainer_steps(run))
        trainer(signal.SIGCONT)
        assert facts["left_at"] < STEPS
        rl.wait(timeout=900)
    finally:
        trainer(signal.SIGCONT)
        if rl.poll() is None:
            rl.send_signal(signal.SIGINT)
            rl.wait(timeout=120)
        for proc in started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=120)
    facts["second_name"] = second_name
    return run, rl.returncode, console.read_text(), tmp, facts


@pytest.mark.xdist_group("elastic_run")
def test_the_run_finishes_every_step_once_with_every_rollout_accounted_for(elastic_run):
    run, code, console, _, _ = elastic_run
    assert code == 0, console[-3000:]
    assert trainer_steps(run) == list(range(STEPS)), console[-3000:]
    orch = orchestrator_metrics(run)
    assert [m["step"] for m in orch] == list(range(STEPS))
    last = orch[-1]
    pending = last["rollouts/all/inflight"] + last["rollouts/all/waiting"]
    buckets = sum(last[f"rollouts/all/{b}_total"] for b in ("trained", "filtered", "failed", "stale"))
    assert last["rollouts/all/dispatched_total"] == buckets + pending
    records = [
        json.loads(x) for p in sorted((run / "rollouts").glob("*.jsonl")) for x in p.read_text().splitlines()
    ]
    failed = [r for r in records if r.get("error")]
    assert all(r["error"].strip() for r in failed)  # every failure says why


@pytest.mark.xdist_group("elastic_run")
def test_a_server_that_joins_gets_groups_on_the_current_weights_and_drains_with_status_0(elastic_run):
    run, _, console, tmp, facts = elastic_run
    name = facts["second_name"]
    log = (run / "logs" / "orchestrator.log").read_text()
    assert f"inference server http://{name} registers" in log
    assert f"inference server http://{name} joined the pool" in log
    served = [m for m in orchestrator_metrics(run) if m.get(f"pool/{name}/groups")]
    assert served, "the second server got no groups"
    # Never a stale version: each step it served, it served the step's policy version.
    assert all(m[f"pool/{name}/step"] == m["policy_version"] for m in served), [
        (m["step"], m[f"pool/{name}/step"], m["policy_version"]) for m in served
    ]
    assert "| pool 2 serving" in console, console[-3000:]  # the step line shows the pool
    assert facts["second_status"] == 0, (tmp / "second.log").read_text()[-3000:]
    assert f"inference server http://{name} left the pool" in log
    assert "left the run's pool" in (tmp / "second.log").read_text()


@pytest.mark.xdist_group("elastic_run")
def test_a_server_with_another_secret_sends_the_run_nothing_and_stops_in_one_line(elastic_run):
    run, _, _, tmp, facts = elastic_run
    assert facts["third_status"] == 2
    third = (tmp / "third.log").read_text()
    refusals = [line for line in third.splitlines() if "inference: error:" in line]
    assert len(refusals) == 1 and "did not prove it holds this server's secret" in refusals[0], third[-3000:]
    # The server sent the run nothing but a challenge: no join to refuse, no signature to keep.
    log = (run / "logs" / "orchestrator.log").read_text()
    assert "POST /pool/join" not in log


@pytest.mark.xdist_group("elastic_run")
def test_the_first_server_killed_mid_run_is_restarted_and_the_run_goes_on(elastic_run):
    run, _, console, _, _ = elastic_run
    assert "rl: inference" in console and "restarting it (1 of 3)" in console, console[-3000:]
    log = (run / "logs" / "orchestrator.log").read_text()
    assert "does not answer: no new rollouts go to it until it is back" in log
    assert "is back after" in log  # reloaded with the run's weights before it got work again


def test_with_the_collective_broadcast_a_server_that_joins_takes_the_next_update(tiny_model, tmp_path):
    """`weight_broadcast.type = "collective"`: the broadcast's group is formed anew at every update
    with the pool's members, so a server that joins mid-run (at step 10; the trainer is held meanwhile) gets the
    next step's weights in memory, then groups, and always serves the version its groups are tagged
    with; every step trains once."""
    steps = 18
    extra = (
        '[trainer.weight_broadcast]\ntype = "collective"\n'
        "[deployment]\nmax_restarts = 1\nstall_timeout_s = 0\n"
    )
    toml = write_config(tmp_path, tiny_model, "reverse-text", steps=steps, extra=extra)
    run, console = tmp_path / "run", tmp_path / "rl.console"
    with console.open("w") as out:
        rl = subprocess.Popen([str(BIN / "rl"), "@", str(toml)], stdout=out, stderr=subprocess.STDOUT)
    second = None

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 600
        while not condition():
            assert rl.poll() is None, f"rl ended while waiting for {what}: {console.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"{what}: {console.read_text()[-3000:]}"
            time.sleep(0.2)

    def trainer(sig: signal.Signals) -> None:
        for s in activity.read_all(run / "activity"):
            if s.kind == "trainer" and s.running():
                os.kill(s.pid, sig)

    try:
        wait_for(lambda: len(trainer_steps(run)) >= 10, "10 trainer steps")
        trainer(signal.SIGSTOP)
        second, name = start_server(tmp_path, "second", tiny_model, run, run / ".secret")
        log = run / "logs" / "orchestrator.log"
        wait_for(lambda: f"inference server http://{name} registers" in log.read_text(), "the registration")
        joined_at = len(trainer_steps(run))
        trainer(signal.SIGCONT)
        rl.wait(timeout=900)
        second.wait(timeout=120)  # it stops by itself once the run is over
    finally:
        trainer(signal.SIGCONT)
        if rl.poll() is None:
            rl.send_signal(signal.SIGINT)
            rl.wait(timeout=120)
        if second is not None and second.poll() is None:
            second.send_signal(signal.SIGTERM)
            second.wait(timeout=120)
    text = console.read_text()
    assert rl.returncode == 0, text[-3000:]
    assert trainer_steps(run) == list(range(steps)), text[-3000:]
    assert joined_at < steps
    assert second.returncode == 0, (tmp_path / "second.log").read_text()[-3000:]
    served = [m for m in orchestrator_metrics(run) if m.get(f"pool/{name}/groups")]
    assert served, "the server that joined got no groups: " + text[-3000:]
    assert all(m[f"pool/{name}/step"] == m["policy_version"] for m in served)
    # Its weights came in memory only: broadcast updates, never a file load.
    second_log = (tmp_path / "second.log").read_text()
    assert "POST /prime_rl/receive_weights" in second_log and "POST /prime_rl/load_weights" not in second_log
