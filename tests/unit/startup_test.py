"""`rl`'s start: the trainer and the orchestrator run while the servers start; the watch loop says
when every server is healthy, and stops everything, with one line, when a server exits first or is
not healthy within `deployment.startup_timeout_s`. The children are small Python processes."""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from prime_rl.launcher.child import Child, start_child
from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.supervisor import Launcher
from prime_rl.orchestrator.envs.teacher import Teacher, TeacherError
from prime_rl.orchestrator.envs_config import TeacherConfig
from prime_rl.runtime.net import free_port

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


@pytest.fixture
def launcher():
    """A launcher factory; every child a test started is stopped after it, even when it fails."""
    made: list[Launcher] = []

    def make(tmp_path: Path, startup_timeout_s: float = 60.0) -> Launcher:
        made.append(
            Launcher(RLConfig(output_dir=tmp_path, deployment={"startup_timeout_s": startup_timeout_s}))
        )
        return made[-1]

    yield make
    for rl in made:
        rl.stop_all()


def test_the_workers_run_while_the_server_starts_and_the_console_says_when_it_is_up(
    launcher, tmp_path, capsys
):
    rl = launcher(tmp_path)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = child(rl, "inference", SERVER, str(tmp_path / "go"), str(port))
    # The server comes up only once the worker has run: with a worker started after the server's
    # health, this would wait until the start-up timeout and fail.
    worker = child(rl, "trainer", WORKER, str(tmp_path / "go"), url)
    assert rl.watch([server], [worker], {"inference": url}, poll_s=0.05) == 0
    assert capsys.readouterr().out.count("rl: inference is up") == 1


def test_a_server_that_exits_before_it_is_healthy_stops_everything_with_one_line(launcher, tmp_path, capsys):
    rl = launcher(tmp_path)
    server = child(rl, "inference", "import os; os._exit(3)")
    worker = child(rl, "trainer", "import time; time.sleep(600)")
    assert rl.watch([server], [worker], {"inference": f"http://127.0.0.1:{free_port()}"}, poll_s=0.05) == 1
    err = capsys.readouterr().err
    assert "rl: error: inference: the inference server exited with status 3 before it was healthy" in err
    assert worker.proc.poll() is not None  # stopped with the run


def test_a_server_not_healthy_within_the_startup_timeout_stops_everything(launcher, tmp_path, capsys):
    rl = launcher(tmp_path, startup_timeout_s=1.0)
    url = f"http://127.0.0.1:{free_port()}"
    server = child(rl, "inference", "import time; time.sleep(600)")
    worker = child(rl, "trainer", "import time; time.sleep(600)")
    assert rl.watch([server], [worker], {"inference": url}, poll_s=0.05) == 1
    assert f"the inference server at {url} was not healthy after 1 s" in capsys.readouterr().err
    assert server.proc.poll() is not None and worker.proc.poll() is not None


class Models(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"data": [{"id": "teacher-model"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_the_teacher_check_waits_for_a_teacher_server_that_is_still_starting():
    """`rl` starts the orchestrator while it starts the teacher's server: the check asks again until
    the server answers (up to `wait_s`), and without time to wait it fails with the URL."""
    port = free_port()
    config = TeacherConfig(base_url=f"http://127.0.0.1:{port}/v1")
    with pytest.raises(TeacherError, match=f"127.0.0.1:{port}/v1 does not answer /models"):
        asyncio.run(Teacher(config).check())

    async def started_later() -> str:
        teacher = Teacher(config)
        check = asyncio.create_task(teacher.check(wait_s=60))
        await asyncio.sleep(0)  # the check has found nobody there
        server = ThreadingHTTPServer(("127.0.0.1", port), Models)
        thread = threading.Thread(target=server.serve_forever)
        thread.start()
        try:
            await check
        finally:
            server.shutdown()
            server.server_close()
            thread.join()
        return teacher.model

    assert asyncio.run(started_later()) == "teacher-model"


def test_a_line_waiting_for_a_server_rl_starts_stays_in_the_log(tmp_path, capsys):
    """`rl` says itself when its servers are up; a child's lines waiting for them are in its log only.
    Waiting for another server (another machine's) still shows."""
    lines = [
        "orchestrator waiting for inference server http://127.0.0.1:8000 (ConnectError)",
        "orchestrator waiting for inference server http://10.0.0.2:8000 (ConnectError)",
        "orchestrator step 0 | done",
    ]
    code = "print(" + repr("\n".join(lines)) + ", flush=True)"
    log = tmp_path / "orchestrator.log"
    child = start_child("orchestrator", [sys.executable, "-c", code], dict(os.environ), None, log, True,
                        quiet=("http://127.0.0.1:8000",))  # fmt: skip
    child.proc.wait()
    shown, deadline = "", time.monotonic() + 60
    while "step 0 | done" not in shown:  # the pump thread writes the console after the log
        assert time.monotonic() < deadline, shown
        shown += capsys.readouterr().out
        time.sleep(0.01)
    assert log.read_text().splitlines() == lines
    assert "127.0.0.1:8000" not in shown and "waiting for inference server http://10.0.0.2:8000" in shown
