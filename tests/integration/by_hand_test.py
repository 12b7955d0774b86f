"""The three processes started by hand, as three commands from the shipped configs
(`configs/reverse_text/{inference,trainer,orchestrator}.toml`), with a real vLLM server.

Only what a test must change is set on the command line: the output dir (in tmp_path, the same
flag for all three), the ports (free ones, so that tests may run beside anything) and max_steps.
An orchestrator whose output dir the server does not load from stops at start-up with one line; the
shipped configs run to the end with every dispatched rollout accounted for once and the trainer on
the same steps; Ctrl-C stops the server, serving or starting, within seconds with its one line.
"""

import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import httpx
import psutil
import pytest

from helpers.cores import server_env
from prime_rl.auth.clients import Signed
from prime_rl.engine.server import wait_until_healthy
from prime_rl.runtime import secret
from prime_rl.runtime.monitor import read_metrics
from prime_rl.runtime.net import free_port
from prime_rl.runtime.shutdown import GRACE_S

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs" / "reverse_text"
BIN = Path(sys.executable).parent
STEPS = 3
STOP_BOUND_S = 3 * GRACE_S + 30.0
"""What a stop is held to: several times the grace period every stop is given, plus an interpreter's
exit on a loaded machine. A stop that fails does not come late but never (the process waits on)."""
BUCKETS = ("trained", "filtered", "failed", "stale")


class Process:
    """One terminal: a command from the repo root, in a session of its own (a terminal's Ctrl-C
    reaches the foreground job's process group), its output in a file."""

    def __init__(self, name: str, args: list[str], folder: Path, secret_file: Path | None = None):
        self.name, self.log = name, folder / f"{name}.log"
        env = server_env()  # a server's threads on this worker's cores
        # As a user starts them: no secret given, and no opt-out, so the three take the run's from
        # their output folder (the first to start makes it); or the one file given.
        env.pop(secret.NO_SECRET_ENV, None)
        if secret_file is not None:
            env[secret.FILE_ENV] = str(secret_file)
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [str(BIN / name), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
                env=env,
            )

    def output(self) -> str:
        return self.log.read_text()

    def ctrl_c(self) -> str:
        """SIGINT to the process group; the output after it, once the process has stopped."""
        before = len(self.output())
        t0 = time.monotonic()
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=STOP_BOUND_S + 60)
        finally:
            self.kill()
        took = time.monotonic() - t0
        after = self.output()[before:]
        assert self.proc.returncode == 128 + signal.SIGINT, self.output()[-3000:]
        # wall-clock: a stop within GRACE_S is the invariant under test (STOP_BOUND_S)
        assert took < STOP_BOUND_S, f"took {took:.1f} s to stop\n{after}"
        return after

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def vllm_processes(port: int) -> list[psutil.Process]:
    """The vLLM server on `port` and its engine processes, if any are left."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "prime_rl.inference.vllm_server" in cmd and str(port) in cmd:
            found += [p, *p.children(recursive=True)]
    return found


class Server(NamedTuple):
    process: Process
    port: int
    run: Path
    """The output dir the server was started with: its weights load from <run>/weights."""
    secret: Path
    """The run secret's file, which the server made in its output folder, where the trainer and the
    orchestrator of the run find it."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`uv run inference @ configs/reverse_text/inference.toml`, serving until the last test stops it."""
    folder = tmp_path_factory.mktemp("by-hand")
    port = free_port()
    args = [
        "@",
        str(CONFIGS / "inference.toml"),
        "--output-dir",
        str(folder / "run"),
        "--server.port",
        str(port),
    ]
    process = Process("inference", args, folder)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", timeout_s=600, process=process.proc)
        made = folder / "run" / secret.FILE_NAME  # by the server, given no secret: safe by default
        assert made.stat().st_mode & 0o777 == 0o600
        yield Server(process, port, folder / "run", made)
    finally:
        if process.proc.poll() is None:
            os.killpg(process.proc.pid, signal.SIGTERM)
            try:
                process.proc.wait(timeout=60)
            finally:
                process.kill()


def intrude(server: Server) -> bool:
    """A neighbour without the run's secret calls every route that changes what the server serves:
    each is refused (401), and the run must not notice."""
    weights = server.run / "weights"
    step = max(int(p.name.removeprefix("step_")) for p in weights.glob("step_*") if (p / "READY").exists())
    calls = {
        "/prime_rl/load_weights": {"path": str(weights / f"step_{step}"), "step": step + 100},
        "/prime_rl/receive_weights": {"step": step + 100, "host": "10.255.255.1", "port": 1, "prefix": "x/",
                                      "first_rank": 1, "world_size": 2, "plan": [], "timeout_s": 600},
        "/prime_rl/load_adapter": {"name": "x", "owner": "x"},
        "/prime_rl/unload_adapter": {"name": "x", "owner": "x"},
        "/v1/chat/completions": {"model": "x", "messages": [{"role": "user", "content": "x"}]},
        "/v1/load_lora_adapter": {"lora_name": "x", "lora_path": str(weights)},
    }  # fmt: skip
    the_secret = secret.read(server.secret)  # sent as it once was: no longer worth anything
    for headers in (
        {},
        {"Authorization": "Bearer not-the-secret"},
        {"Authorization": f"Bearer {the_secret}"},
    ):
        for route, body in calls.items():
            answer = httpx.post(f"{server.url}{route}", json=body, headers=headers, timeout=30)
            assert answer.status_code == 401, (route, answer.status_code, answer.text[:300])
    return True


def orchestrator_args(run: Path, server: Server, transport_port: int) -> list[str]:
    return [
        "@", str(CONFIGS / "orchestrator.toml"), "--output-dir", str(run), "--max-steps", str(STEPS),
        "--client.base-urls", f'["{server.url}/v1"]', "--transport.port", str(transport_port),
    ]  # fmt: skip


def test_an_orchestrator_the_server_would_refuse_stops_at_start_up(server, tmp_path):
    # As in the issue: trainer and orchestrator given an output dir, the server left at another.
    elsewhere = tmp_path / "manual"
    orch = Process("orchestrator", orchestrator_args(elsewhere, server, free_port()), tmp_path, server.secret)
    try:
        orch.proc.wait(timeout=300)
    finally:
        orch.kill()
    out = orch.output()
    assert orch.proc.returncode == 2, out[-3000:]
    errors = [line for line in out.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in out, out[-3000:]
    line = errors[0]
    assert "orchestrator.output_dir" in line and "inference.output_dir" in line and "--output-dir" in line
    assert str(elsewhere / "weights") in line and str((server.run / "weights").resolve()) in line
    assert not (elsewhere / "rollouts").exists()  # stopped before the first rollout, not at a reload


def test_the_shipped_configs_run_three_processes_by_hand(server, tmp_path):
    transport = free_port()
    trainer_args = ["@", str(CONFIGS / "trainer.toml"), "--output-dir", str(server.run),
                    "--max-steps", str(STEPS), "--transport.port", str(transport)]  # fmt: skip
    # No secret given: both read the one the server made in the run's output folder.
    trainer = Process("trainer", trainer_args, tmp_path)
    orch = Process("orchestrator", orchestrator_args(server.run, server, transport), tmp_path)
    intruded = False
    try:
        deadline = time.monotonic() + 900
        while (trainer.proc.poll() is None or orch.proc.poll() is None) and time.monotonic() < deadline:
            failed = [p for p in (trainer, orch) if p.proc.poll() not in (None, 0)]
            assert not failed, "\n".join(f"{p.name}:\n{p.output()[-3000:]}" for p in failed)
            if not intruded and (server.run / "weights" / "step_1" / "READY").exists():
                intruded = intrude(server)  # mid-run, once the server took the run's weights
            time.sleep(0.5)
    finally:
        trainer.kill()
        orch.kill()
    assert trainer.proc.returncode == 0, trainer.output()[-3000:]
    assert orch.proc.returncode == 0, orch.output()[-3000:]
    assert "Traceback" not in trainer.output() + orch.output()

    run = server.run
    records = read_metrics(run / "orchestrator" / "metrics.jsonl")
    steps = [m for m in records if "rollouts/all/dispatched" in m]
    assert [m["step"] for m in steps] == list(range(STEPS))
    assert [m["step"] for m in records if "eval/reverse-text-eval/reward/mean" in m] == [0]  # eval at start
    # Every dispatched rollout is in exactly one bucket, or still in flight or waiting when counted.
    for m in steps:
        accounted = sum(m[f"rollouts/all/{b}_total"] for b in BUCKETS)
        assert (
            m["rollouts/all/dispatched_total"]
            == accounted + m["rollouts/all/inflight"] + m["rollouts/all/waiting"]
        )
    for key in ("dispatched", *BUCKETS):  # the steps' counts add up to the totals: none counted twice
        assert sum(m[f"rollouts/all/{key}"] for m in steps) == steps[-1][f"rollouts/all/{key}_total"]
    # Each step's rollouts file holds that step's trained, filtered and failed rollouts, once each.
    for m in steps:
        with (run / "rollouts" / f"step_{m['step']:06d}.jsonl").open() as f:
            kinds = Counter(
                {True: "trained", False: "filtered", None: "failed"}[r["trained"]] for r in map(json.loads, f)
            )
        assert kinds == Counter({b: m[f"rollouts/all/{b}"] for b in ("trained", "filtered", "failed")}), m[
            "step"
        ]
    assert sum(m["rollouts/all/trained"] for m in steps) > 0
    # The trainer trained the same steps, each on exactly the tokens the orchestrator sent for it.
    trained = read_metrics(run / "trainer" / "metrics.jsonl")
    assert [m["step"] for m in trained] == list(range(STEPS))
    assert [m["tokens"] for m in trained] == [m["batch/tokens"] for m in steps]
    # The server took the trainer's weights (the reload the issue saw refused), and generation kept
    # within max_async_level of them.
    assert all((run / "weights" / f"step_{s}" / "READY").exists() for s in range(1, STEPS + 1))
    assert intruded
    key = hmac.new(secret.read(server.secret).encode(), b"requests", hashlib.sha256).digest()
    served = httpx.get(f"{server.url}/prime_rl/weights", timeout=10, auth=Signed(key))
    assert served.json()["step"] >= 1
    versions = [m["policy_version"] for m in steps]
    assert versions[-1] >= 1 and all(s - v <= 1 for s, v in enumerate(versions))

    # Ctrl-C on the serving server: its one line, nothing left running.
    after = server.process.ctrl_c()
    assert after.count("inference stopped by SIGINT") == 1 and "Traceback" not in after, after
    assert not vllm_processes(server.port)


def test_ctrl_c_stops_an_inference_server_while_it_starts(tmp_path):
    port = free_port()
    args = [
        "@",
        str(CONFIGS / "inference.toml"),
        "--output-dir",
        str(tmp_path / "run"),
        "--server.port",
        str(port),
    ]
    inference = Process("inference", args, tmp_path)
    try:
        deadline = time.monotonic() + 600
        # The engine process is starting (left to itself, vLLM printed a traceback when stopped here).
        while "EngineCore" not in inference.output() and time.monotonic() < deadline:
            assert inference.proc.poll() is None, inference.output()[-3000:]
            time.sleep(0.1)
        after = inference.ctrl_c()
    finally:
        inference.kill()
    assert after.count("inference stopped by SIGINT") == 1 and "Traceback" not in after, after
    assert not vllm_processes(port)
