"""`rl`'s start: the trainer and the orchestrator run while the servers start; the watch loop says
when every server is healthy, and stops everything, with one line, when a server exits first or is
not healthy within `deployment.startup_timeout_s`. The children are small Python processes."""

import asyncio
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from prime_rl.net import free_port
from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.loop.servers import InferenceUnavailable, ServerPool
from prime_rl.rl.child import Child
from prime_rl.rl.config import RLConfig
from prime_rl.rl.launcher import Launcher

# A server that answers /health only once `go` exists.
SERVER = """
import http.server, pathlib, sys, time
go, port = pathlib.Path(sys.argv[1]), int(sys.argv[2])
while not go.exists():
    time.sleep(0.01)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""

# A worker that lets the server come up, then waits until it answers.
WORKER = """
import pathlib, sys, time, urllib.request
pathlib.Path(sys.argv[1]).touch()
while True:
    try:
        urllib.request.urlopen(sys.argv[2] + "/health", timeout=1); break
    except OSError:
        time.sleep(0.05)
"""


def child(launcher: Launcher, name: str, *args: str) -> Child:
    proc = subprocess.Popen([sys.executable, "-c", *args], start_new_session=True)
    c = Child(name, proc, launcher.out / f"{name}.log", "policy" if name == "inference" else "")
    launcher.children.append(c)
    return c


def launcher(tmp_path: Path, startup_timeout_s: float = 60.0) -> Launcher:
    return Launcher(RLConfig(output_dir=tmp_path, deployment={"startup_timeout_s": startup_timeout_s}))


def test_the_workers_run_while_the_server_starts_and_the_console_says_when_it_is_up(tmp_path, capsys):
    rl = launcher(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = child(rl, "inference", SERVER, str(tmp_path / "go"), str(port))
    # The server comes up only once the worker has run: with a worker started after the server's
    # health, this would wait until the start-up timeout and fail.
    worker = child(rl, "trainer", WORKER, str(tmp_path / "go"), url)
    assert rl.watch([server], [worker], {"inference": url}, poll_s=0.05) == 0
    assert capsys.readouterr().out.count("rl: inference is up") == 1


def test_a_server_that_exits_before_it_is_healthy_stops_everything_with_one_line(tmp_path, capsys):
    rl = launcher(tmp_path)
    server = child(rl, "inference", "import os; os._exit(3)")
    worker = child(rl, "trainer", "import time; time.sleep(600)")
    assert rl.watch([server], [worker], {"inference": f"http://127.0.0.1:{free_port()}"}, poll_s=0.05) == 1
    err = capsys.readouterr().err
    assert "rl: error: inference: the inference server exited with status 3 before it was healthy" in err
    assert worker.proc.poll() is not None  # stopped with the run


def test_a_server_not_healthy_within_the_startup_timeout_stops_everything(tmp_path, capsys):
    rl = launcher(tmp_path, startup_timeout_s=1.0)
    url = f"http://127.0.0.1:{free_port()}"
    server = child(rl, "inference", "import time; time.sleep(600)")
    worker = child(rl, "trainer", "import time; time.sleep(600)")
    assert rl.watch([server], [worker], {"inference": url}, poll_s=0.05) == 1
    assert f"the inference server at {url} was not healthy after 1 s" in capsys.readouterr().err
    assert server.proc.poll() is not None and worker.proc.poll() is not None


class Healthy(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_orchestrator_waits_for_the_teacher_server_too():
    """`rl` starts the orchestrator while the policy and teacher servers start: the orchestrator must
    not ask a teacher that is not up yet."""
    policy = ThreadingHTTPServer(("127.0.0.1", 0), Healthy)
    thread = threading.Thread(target=policy.serve_forever)
    thread.start()
    try:
        pool = ServerPool(
            ClientConfig(base_urls=[f"http://127.0.0.1:{policy.server_port}/v1"], health_timeout_s=1)
        )
        asyncio.run(pool.wait_healthy())  # the policy server alone answers
        teacher = f"http://127.0.0.1:{free_port()}/v1"
        with pytest.raises(InferenceUnavailable, match=teacher.removesuffix("/v1")):
            asyncio.run(pool.wait_healthy(also=(teacher,)))
    finally:
        policy.shutdown()
        policy.server_close()
        thread.join()
