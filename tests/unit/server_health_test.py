"""Fault test: an inference server is killed mid-run and restarted (a fake server in its own process,
SIGKILLed). The orchestrator keeps work off it, waits, puts the current weights back on it before it
serves again, and finishes every step once with exact rollout accounting."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from fake_server import MODEL
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.loop.servers import InferenceUnavailable
from prime_rl.orchestrator.main import make_orchestrator
from prime_rl.runtime.monitor import read_metrics

FAKE_SERVER = Path(__file__).parents[1] / "fake_server.py"


class ServerProcess:
    """The fake inference server as a process that can be killed and started again on its port."""

    def __init__(self, delay_s: float):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.delay_s = delay_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(FAKE_SERVER.parent)}
        args = [
            sys.executable,
            "-m",
            "prime_rl.runtime.start",
            "fake_server",
            str(self.port),
            str(self.delay_s),
        ]
        self.proc = subprocess.Popen(args, env=env)
        wait_for(lambda: self.get("/health") is not None, "the fake server to start")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def get(self, route: str):
        try:
            return httpx.get(self.url + route, timeout=2).json()
        except httpx.HTTPError:
            return None


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


def publish(run: Path, step: int) -> None:
    """What the trainer does after step N (the fake server accepts the folder as it is)."""
    d = run / "weights" / f"step_{step}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "READY").touch()


def publish_broadcast(run: Path, step: int, server: ServerProcess) -> None:
    """What the trainer does after step N with `weight_broadcast.type = "collective"`: the weights go
    to the servers that answer, then a folder with only the markers."""
    if server.proc.poll() is None:
        httpx.post(server.url + "/fake/broadcast", json={"step": step}, timeout=60)
    d = run / "weights" / f"step_{step}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "BROADCAST").write_text("{}")
    (d / "READY").touch()


def metric_steps(run: Path) -> list[int]:
    path = run / "orchestrator" / "metrics.jsonl"
    return [m["step"] for m in read_metrics(path)] if path.exists() else []


@pytest.fixture
def server(request):
    srv = ServerProcess(delay_s=request.param)
    srv.start()
    yield srv
    if srv.proc.poll() is None:
        srv.kill()


def config(run: Path, server: ServerProcess, **overrides) -> OrchestratorConfig:
    base = {
        "output_dir": str(run),
        "model": {"name": MODEL},
        "max_steps": 6,
        "batch_size": 8,
        "max_async_level": 1,
        "max_inflight_rollouts": 8,
        "seq_len": 256,
        "envs": [{"id": "reverse-text", "group_size": 4, "sampling": {"max_tokens": 16}}],
        "client": {"base_urls": [server.url + "/v1"], "timeout_s": 10, "health_interval_s": 0.2},
        "transport": {"type": "filesystem", "run_id": "test"},
        "filters": [],
    }
    return OrchestratorConfig(**{**base, **overrides})


def run_with(cfg: OrchestratorConfig, scenario) -> BaseException | None:
    """Run the orchestrator here (verifiers loads envs only in the main thread) while `scenario`
    plays the trainer and the operator in a thread; return what the orchestrator raised, if anything.
    """
    failures: list[BaseException] = []

    def target():
        try:
            scenario()
        except BaseException as e:
            failures.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    raised = None
    try:
        asyncio.run(asyncio.wait_for(make_orchestrator(cfg).run(), timeout=120))
    except Exception as e:
        raised = e
    thread.join(timeout=30)
    if failures:
        raise failures[0]
    return raised


def check_accounting(run: Path) -> list[dict]:
    metrics = read_metrics(run / "orchestrator" / "metrics.jsonl")
    for m in metrics:
        buckets = sum(m[f"rollouts/all/{b}_total"] for b in ("trained", "filtered", "failed", "stale"))
        assert (
            m["rollouts/all/dispatched_total"]
            == buckets + m["rollouts/all/inflight"] + m["rollouts/all/waiting"]
        )
    return metrics


@pytest.mark.parametrize("server", [0.0], indirect=True)
def test_a_server_restarted_between_requests_gets_the_weights_back_before_serving(tmp_path, server):
    run = tmp_path / "run"

    def scenario():
        # Steps 0 and 1 need no new weights; step 2 waits for the trainer's weights of step 1.
        wait_for(lambda: metric_steps(run) == [0, 1], "steps 0 and 1")
        publish(run, 1)
        wait_for(lambda: (server.get("/prime_rl/weights") or {}).get("step") == 1, "the reload of step 1")
        wait_for(lambda: metric_steps(run) == [0, 1, 2], "step 2")
        # Step 3 now waits for weights 2, so nothing is in flight: the restart fails no request and
        # only the periodic check can notice that the server came back serving the base model.
        server.kill()
        server.start()
        wait_for(lambda: server.get("/fake/events"), "the orchestrator to notice the restart")
        for step in (2, 3, 4):
            publish(run, step)

    assert run_with(config(run, server), scenario) is None
    events = server.get("/fake/events")
    assert events[0] == "load 1" and "chat" in events  # the current weights first, then rollouts
    metrics = check_accounting(run)
    assert [m["step"] for m in metrics] == list(range(6))
    assert sum(m["rollouts/all/failed"] for m in metrics) == 0


# Replies take 1 s, so the 4 steps left after the kill take seconds: the kill lands with rollouts in
# flight however fast the machine (the orchestrator keeps dispatching until its last step).
@pytest.mark.parametrize("server", [1.0], indirect=True)
def test_a_server_killed_with_rollouts_in_flight_is_waited_for_and_resynced(tmp_path, server):
    run = tmp_path / "run"
    publish(run, 1)  # the run starts on published weights, which a restarted server lacks
    cfg = config(run, server, max_async_level=10, resume=True)

    def scenario():
        wait_for(lambda: len(metric_steps(run)) >= 2, "two steps")
        assert len(metric_steps(run)) < 6, "the run ended before the kill"
        server.kill()  # rollouts of the next step are in flight
        time.sleep(2.0)  # down for a while (what follows holds for any downtime)
        server.start()

    assert run_with(cfg, scenario) is None
    metrics = check_accounting(run)
    assert [m["step"] for m in metrics] == list(range(6))  # every step once
    failed = sum(m["rollouts/all/failed"] for m in metrics)
    # The rollouts on the killed server fail; while it is down, nothing more is sent to fail.
    assert 0 < failed <= 2 * cfg.max_inflight_rollouts
    events = server.get("/fake/events")
    assert events[0] == "load 1" and "chat" in events[1:]


@pytest.mark.parametrize("server", [0.0], indirect=True)
def test_no_server_back_within_the_timeout_is_a_clear_error(tmp_path, server):
    run = tmp_path / "run"
    client = {"base_urls": [server.url + "/v1"], "health_interval_s": 0.2, "health_timeout_s": 1.5}
    cfg = config(run, server, max_async_level=0, client=client)

    def scenario():
        wait_for(lambda: metric_steps(run) == [0], "step 0")
        server.kill()
        publish(run, 1)  # the reload fails: the server is down and never returns

    error = run_with(cfg, scenario)
    assert isinstance(error, InferenceUnavailable) and "no inference server answered for 2 s" in str(error)
    assert (run / "orchestrator" / "progress.json").exists()  # step 0 is saved for a resume


@pytest.mark.parametrize("server", [0.0], indirect=True)
def test_with_broadcast_weights_a_restarted_server_gets_no_work_until_a_broadcast_reaches_it(
    tmp_path, server, caplog
):
    run = tmp_path / "run"

    def scenario():
        wait_for(lambda: metric_steps(run) == [0, 1], "steps 0 and 1")
        publish_broadcast(run, 1, server)
        wait_for(lambda: metric_steps(run) == [0, 1, 2], "step 2")
        # Step 3 waits for weights 2. The server comes back on the base model, and there is no
        # file to load it from: it must stay without work until the next broadcast reaches it.
        server.kill()
        server.start()
        wait_for(lambda: "serves step 0, not 1: it gets work again once a weight broadcast" in caplog.text,
                 "the orchestrator to notice", 30)  # fmt: skip
        for step in (2, 3, 4):
            publish_broadcast(run, step, server)

    assert run_with(config(run, server), scenario) is None
    events = server.get("/fake/events")
    assert not any(e.startswith("load") for e in events)  # never told to load files
    assert events[0] == "broadcast 2" and "chat" in events[1:]  # no rollout before the weights came
    metrics = check_accounting(run)
    assert [m["step"] for m in metrics] == list(range(6))


# Replies take 1 s: the freeze lands with rollouts in flight however fast the machine.
@pytest.mark.parametrize("server", [1.0], indirect=True)
def test_a_server_that_stops_answering_loses_its_groups_at_once_and_their_examples_go_again(tmp_path, server):
    """SIGSTOP: the server accepts connections and answers nothing, the shape of a hang. Its groups in
    flight fail after `client.silent_s`, not after the requests' 300 s timeout, and the same examples
    are dispatched again once it is back; nothing is lost or counted twice."""
    run = tmp_path / "run"
    silent_s, timeout_s = 2, 300
    client = {
        "base_urls": [server.url + "/v1"],
        "timeout_s": timeout_s,
        "health_interval_s": 0.2,
        "silent_s": silent_s,
    }
    cfg = config(run, server, max_async_level=10, client=client)
    # Given up after silent_s: a bound of many times that (a loaded machine), yet far from timeout_s.
    give_up_s = 10 * silent_s + 30
    assert give_up_s < timeout_s / 4

    def scenario():
        wait_for(lambda: len(metric_steps(run)) >= 2, "two steps")
        assert len(metric_steps(run)) < 6, "the run ended before the freeze"
        server.proc.send_signal(signal.SIGSTOP)  # rollouts of the next step are in flight
        try:
            # The server stays frozen until its groups are given up (a restart would end it so too).
            wait_for(
                lambda: abandoned.is_set(), "the orchestrator to give up the groups in flight", give_up_s
            )
        finally:
            server.proc.send_signal(signal.SIGCONT)

    abandoned = threading.Event()
    from prime_rl.orchestrator.loop import scheduler

    original = scheduler.Scheduler.abandon

    def abandon(self, srv):
        n = original(self, srv)
        if n:  # groups were in flight on it and are given up
            abandoned.set()
        return n

    scheduler.Scheduler.abandon = abandon
    try:
        assert run_with(cfg, scenario) is None
    finally:
        scheduler.Scheduler.abandon = original
    metrics = check_accounting(run)
    assert [m["step"] for m in metrics] == list(range(6))  # every step once
    records = [
        json.loads(line)
        for p in sorted((run / "rollouts").glob("*.jsonl"))
        for line in p.read_text().splitlines()
    ]
    lost = [r for r in records if "ServerSilentError" in (r.get("error") or "")]
    assert lost, "no rollout failed with the silent server"
    trained = {(r["env"], r["example_id"]) for r in records if r.get("trained")}
    # Each example lost with the frozen server was dispatched again, and trained.
    again = [(r["env"], r["example_id"]) in trained for r in lost]
    assert all(again), [(r["example_id"], a) for r, a in zip(lost, again, strict=True)]
