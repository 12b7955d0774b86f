"""A standalone `orchestrator` stopped by a signal mid-run exits 128+signal, quietly: the envs'
teardown is awaited (verifiers' own handlers would schedule it as a task and exit, printing "Task was
destroyed but it is pending!"), and no traceback is printed."""

import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from server_health_test import ServerProcess, wait_for

ORCHESTRATOR = Path(sys.executable).parent / "orchestrator"


@pytest.fixture
def slow_server():
    """The fake inference server in its own process, answering after 5 s: rollouts stay in flight."""
    srv = ServerProcess(delay_s=5.0)
    srv.start()
    yield srv
    if srv.proc.poll() is None:
        srv.kill()


def chat_requests(server: ServerProcess) -> int:
    return (server.get("/fake/events") or []).count("chat")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_run_stops_the_orchestrator_cleanly(tmp_path, slow_server, sig):
    toml = tmp_path / "orch.toml"
    toml.write_text(
        f"""
output_dir = "{tmp_path / "run"}"
max_steps = 5
batch_size = 8
seq_len = 256
filters = []
client = {{ base_urls = ["{slow_server.url}/v1"] }}
transport = {{ type = "filesystem", run_id = "signals" }}
[[envs]]
id = "reverse-text"
group_size = 4
sampling = {{ max_tokens = 16 }}
"""
    )
    proc = subprocess.Popen(
        [str(ORCHESTRATOR), "@", str(toml)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        wait_for(
            lambda: chat_requests(slow_server) > 0 or proc.poll() is not None,
            "rollouts in flight",
            timeout_s=120,
        )
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, out
    assert f"stopped by {sig.name}" in out
    assert "Task was destroyed" not in out
    assert "Traceback" not in out


def test_a_second_signal_mid_stop_still_reaps_every_child(tmp_path):
    """uv and the shell often both forward a Ctrl-C: the second signal arrives while rl is waiting
    for its children, and must not cut that wait short and leave a child running."""
    helper = Path(__file__).parents[1] / "helpers" / "stubborn_launcher.py"
    err_file = tmp_path / "stderr.txt"
    with err_file.open("w") as err_out:
        proc = subprocess.Popen(
            [sys.executable, str(helper), str(tmp_path)], stdout=subprocess.PIPE, stderr=err_out, text=True
        )
    try:
        child = psutil.Process(int(proc.stdout.readline()))
        proc.send_signal(signal.SIGINT)
        wait_for(
            lambda: proc.poll() is not None or "stopping every process" in err_file.read_text(),
            "rl stopping",
            30,
        )
        proc.send_signal(signal.SIGTERM)  # mid-stop: the child ignores SIGTERM, rl waits its grace period
        proc.wait(timeout=60)
    finally:
        proc.kill()
    err = err_file.read_text()
    assert proc.returncode == 130, err
    assert err.count("stopping every process") == 1
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE


def spawn(launcher, name: str, code: str, group: str = ""):
    from prime_rl.rl.launcher import Child

    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    child = Child(name, proc, launcher.out / f"{name}.log", group)
    launcher.children.append(child)
    return child


@pytest.mark.parametrize("server_code", ["pass", "raise SystemExit(3)"])
def test_rl_stops_everything_when_a_server_exits_whatever_its_status(tmp_path, server_code):
    # vLLM's API server exits 0 when its engine dies: that must stop the run, not go unnoticed.
    from prime_rl.rl.config import RLConfig
    from prime_rl.rl.launcher import Launcher

    launcher = Launcher(RLConfig(output_dir=tmp_path))
    server = spawn(launcher, "teacher", server_code)
    # (Without the rule, watch would return 0 once this worker ended: bounded, so the test fails, not hangs.)
    worker = spawn(launcher, "trainer", "import time; time.sleep(20)")
    assert launcher.watch([server], [worker], poll_s=0.05) == (3 if "3" in server_code else 1)
    assert worker.proc.poll() is not None  # stopped, not left running


def test_rl_succeeds_when_the_workers_finish_and_then_stops_the_servers(tmp_path):
    from prime_rl.rl.config import RLConfig
    from prime_rl.rl.launcher import Launcher

    launcher = Launcher(RLConfig(output_dir=tmp_path))
    server = spawn(launcher, "inference", "import time; time.sleep(600)")
    workers = [spawn(launcher, n, "pass") for n in ("trainer", "orchestrator")]
    assert launcher.watch([server], workers, poll_s=0.05) == 0
    assert server.proc.poll() is not None


def test_one_of_several_policy_servers_exiting_leaves_the_run_going_and_the_last_one_stops_it(tmp_path):
    from prime_rl.rl.config import RLConfig
    from prime_rl.rl.launcher import Launcher

    launcher = Launcher(RLConfig(output_dir=tmp_path))
    dead = spawn(launcher, "inference-0", "raise SystemExit(3)", "policy")
    alive = spawn(launcher, "inference-1", "import time; time.sleep(600)", "policy")
    workers = [spawn(launcher, "trainer", "import time; time.sleep(1)")]
    assert launcher.watch([dead, alive], workers, poll_s=0.05) == 0  # the worker finished: success
    assert dead.proc.returncode == 3 and alive.proc.poll() is not None

    launcher = Launcher(RLConfig(output_dir=tmp_path))
    servers = [spawn(launcher, f"inference-{i}", f"raise SystemExit({i + 2})", "policy") for i in range(2)]
    worker = spawn(launcher, "trainer", "import time; time.sleep(20)")
    assert launcher.watch(servers, [worker], poll_s=0.05) in (2, 3)
    assert worker.proc.poll() is not None
