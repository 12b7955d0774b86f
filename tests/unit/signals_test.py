"""A standalone `orchestrator` stopped by a signal mid-run exits 128+signal, quietly: the envs'
teardown is awaited (verifiers' own handlers would schedule it as a task and exit, printing "Task was
destroyed but it is pending!"), and no traceback is printed."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from prime_rl.net import free_port

FAKE_SERVER = Path(__file__).parents[1] / "fake_server.py"
ORCHESTRATOR = Path(sys.executable).parent / "orchestrator"


def wait_for(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def chat_requests(url: str) -> int:
    try:
        return httpx.get(url + "/fake/events", timeout=2).json().count("chat")
    except httpx.HTTPError:
        return 0


@pytest.fixture
def slow_server():
    """The fake inference server in its own process, answering after 5 s: rollouts stay in flight."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE_SERVER), str(port), "5.0"])
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _healthy(url), "the fake server to start")
    yield url
    proc.kill()
    proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).is_success
    except httpx.HTTPError:
        return False


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
client = {{ base_urls = ["{slow_server}/v1"] }}
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
        wait_for(lambda: chat_requests(slow_server) > 0 or proc.poll() is not None, "rollouts in flight")
        assert proc.poll() is None, proc.communicate()[0]
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig, out
    assert f"stopped by {sig.name}" in out
    assert "Task was destroyed" not in out
    assert "Traceback" not in out
