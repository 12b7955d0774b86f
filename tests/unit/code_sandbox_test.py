"""Model-written code, escaping from the sandbox a rollout at a time: code-add's `python` tool runs
each program the (scripted) model writes, through the orchestrator's own path, in the env's sandbox.
Every attempt is contained (the run's ports, its secret, its files, other processes' environment,
writes outside the scratch folder, bombs of processes, memory, CPU, time and output, a process left
behind), every rollout is accounted for (scored, not failed), the sandbox's failures are counted
per rollout, and the next program runs as before."""

import asyncio
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

import pytest

from helpers.scripted import Scripted
from prime_rl.engine.sampling import SamplingArgs
from prime_rl.orchestrator.envs.renderer import Renderer
from prime_rl.orchestrator.envs.v1_env import load_v1_env
from prime_rl.orchestrator.loop.records import turn_metrics
from prime_rl.orchestrator.loop.step_metrics import sandbox_part
from prime_rl.sandbox.config import SandboxConfig

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="namespaces are Linux's")

MODEL = str(Path(__file__).parents[2] / "models" / "code_add-tiny")


def program(code: str) -> str:
    return f'<tool_call>\n{{"name": "python", "arguments": {json.dumps({"code": code})}}}\n</tool_call>'


def sleepers(seconds: str) -> list[str]:
    """Processes running `sleep <seconds>` (seen from outside the sandbox)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:2] == [b"sleep", seconds.encode()]:
                found.append(pid)
        except OSError:
            pass
    return found


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A run's secret and checkpoints, mode 600 as the run writes them, and its environment."""
    secret = tmp_path / ".secret"
    secret.write_text("root key")
    secret.chmod(0o600)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "model.pt").write_text("weights")
    monkeypatch.setenv("PRIME_RL_SECRET_FILE", str(secret))
    return tmp_path


def play(programs: list[str], config: SandboxConfig) -> list:
    """One rollout per program (its call, then an answer), in one env: (rollout, tool result)."""

    async def go():
        env = load_v1_env("code-add", {}, config)
        renderer = Renderer.for_model(MODEL)
        out = []
        try:
            for code in programs:
                (r,) = await env.run_group(
                    env.first, 0, 1, Scripted(renderer, [program(code), "<answer>0</answer>"]),
                    renderer, "m", SamplingArgs(max_tokens=32), "code-add", 0, [], 120,
                )  # fmt: skip
                out.append((r, r.completion[1]["content"] if not r.failed else None))
        finally:
            await env.close()
        return out

    return asyncio.run(go())


def test_the_runs_ports_secret_files_and_environment_are_out_of_reach(run_dir):
    ports = [socket.create_server(("127.0.0.1", 0)) for _ in range(3)]  # orchestrator, trainer, server
    for p in ports:
        p.setblocking(False)
    numbers = [p.getsockname()[1] for p in ports]
    secret, ckpt = run_dir / ".secret", run_dir / "checkpoints" / "model.pt"
    programs = [
        "import socket\n"
        f"for port in {numbers}:\n"
        "    try:\n"
        "        socket.create_connection(('127.0.0.1', port), timeout=2)\n"
        "        print('connected', port)\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__)",
        f"print(open({str(secret)!r}).read())",
        "import os; print(os.environ.get('PRIME_RL_SECRET_FILE'))",
        f"print(open('/proc/{os.getpid()}/environ').read())",
        f"print(open({str(ckpt)!r}).read())",
        f"open({str(run_dir / 'planted')!r}, 'w').write('x')",
        "open('/usr/lib/planted', 'w').write('x')",
        "open('mine.txt', 'w').write('x'); print(len(open('mine.txt').read()))",
    ]
    results = play(programs, SandboxConfig())
    for p in ports:
        with pytest.raises(BlockingIOError):  # nobody connected
            p.accept()
    assert all(not r.failed for r, _ in results), [r.error for r, _ in results]
    texts = [t for _, t in results]
    assert texts[0] == "ConnectionRefusedError\nConnectionRefusedError\nConnectionRefusedError"
    assert "FileNotFoundError" in texts[1] and "root key" not in texts[1]
    assert texts[2] == "None"
    # Its own PID namespace: the orchestrator is not there (a low pid there is one of its own).
    assert "PRIME_RL_SECRET_FILE" not in texts[3] and (os.getpid() < 1000 or "FileNotFoundError" in texts[3])
    assert "FileNotFoundError" in texts[4] and "weights" not in texts[4]
    assert texts[5].startswith("Error") and not (run_dir / "planted").exists()
    assert texts[6].startswith("Error") and not Path("/usr/lib/planted").exists()
    assert texts[7] == "1"  # its scratch folder is its own to write


def test_bombs_hangs_and_leftovers_fail_their_call_and_the_next_program_runs(run_dir):
    programs = [
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "x = bytearray(8 * 2**30)",
        "while True:\n    pass",
        "import time; time.sleep(600)",
        "import subprocess; subprocess.Popen(['sleep', '1777.5'], start_new_session=True); print('left')",
        "import sys\nfor _ in range(1024):\n    sys.stdout.write('x' * 2**20)",
        "print(2 + 3)",
    ]
    # A deadline shorter than the tool's own: the sandbox, not the tool, stops the hangs.
    results = play(programs, SandboxConfig(timeout_s=3, file_mb=8))
    assert all(not r.failed for r, _ in results), [r.error for r, _ in results]
    texts = [t for _, t in results]
    fork, memory, spin, sleep, left, output, after = texts
    assert fork.startswith("Error: the tool python ran past 3")
    assert "MemoryError" in memory
    assert spin.startswith("Error: the tool python ran past 3")
    assert sleep.startswith("Error: the tool python ran past 3")
    assert [r.sandbox for r, _ in results[:4]] == [{"timeouts": 1}, {}, {"timeouts": 1}, {"timeouts": 1}]
    assert left == "left"
    while sleepers("1777.5"):  # killed once its rollout ended
        time.sleep(0.01)
    # Its file stopped at `file_mb` (Python reports the limit as an error, not a signal).
    assert re.match(r"Error: RuntimeError: exit status \d+: x+$", output) and len(output) < 300
    assert after == "5"
    # Counted per env and step, and named on the step line.
    m = turn_metrics("code-add", [r for r, _ in results])
    assert (m["sandbox/code-add/timeouts"], m["sandbox/code-add/oom"], m["sandbox/code-add/killed"]) == (
        3,
        0,
        0,
    )
    assert sandbox_part(m, ["code-add"]) == " | sandbox failures: code-add timeouts 3"


def test_the_step_line_names_an_env_whose_tools_run_unsandboxed():
    assert sandbox_part({"sandbox/code-add/off": 1}, ["code-add"]) == " | TOOLS UNSANDBOXED: code-add"
    assert sandbox_part({}, ["code-add"]) == ""
