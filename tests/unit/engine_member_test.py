"""vLLM's engine in the orchestrator is a pool member like a server: when its engine core dies, its
groups in flight go to the next dispatch (not counted against `max_failed_groups`), the engine is
restarted within `client.max_restarts` and loaded with the current weights before it gets work, and
what a crash of the orchestrator would lose is dispatched first by the next one."""

import asyncio
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from fake_server import MODEL, FakeServer, Reply
from prime_rl.launcher.processes import kill_culprit, process_tree
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs.local import LocalEnvs
from prime_rl.orchestrator.loop.health import ServerHealth
from prime_rl.orchestrator.loop.scheduler import Scheduler
from prime_rl.orchestrator.loop.servers import InferenceUnavailable, ServerPool
from prime_rl.orchestrator.loop.weights import WeightSync
from prime_rl.runtime import activity
from prime_rl.runtime.layout import READY


class DyingEngine:
    """What the health monitor and the scheduler see of `LocalEngine`: it can die and be restarted."""

    def __init__(self):
        self.stopped = False
        self.step = 0
        self.restarts = 0
        self.loads: list[int] = []

    @property
    def served_step(self) -> int:
        return self.step

    async def restart(self):
        self.restarts += 1
        self.stopped, self.step = False, 0
        return self

    async def load_weights(self, path: Path, step: int):
        self.loads.append(step)
        self.step = step


def publish(root: Path, step: int) -> None:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / READY).touch()


def test_a_dead_engine_is_restarted_loaded_with_the_current_weights_then_gets_work(tmp_path):
    async def scenario():
        config = OrchestratorConfig(client={"max_restarts": 1})
        engine = DyingEngine()
        pool = ServerPool(config.client, engine)
        (server,) = pool.servers
        publish(tmp_path, 3)
        weights = WeightSync(tmp_path, pool, version=3)
        engine.step = 3
        abandoned, restarts = [], []
        health = ServerHealth(
            pool, weights, 0.05, 60, on_silent=lambda s: abandoned.append(s) or 2, max_restarts=1,
            on_restart=restarts.append,
        )  # fmt: skip
        monitor = asyncio.create_task(health.run())
        engine.stopped = True  # its engine core died
        pool.suspect(server)
        while engine.loads != [3] or not server.up:
            await asyncio.sleep(0.01)
        assert engine.restarts == 1 and abandoned == [server] and restarts == [1]
        assert health.error is None
        engine.stopped = True  # again, with no restart left: the orchestrator stops, saying why
        while health.error is None:
            await asyncio.sleep(0.01)
        assert isinstance(health.error, InferenceUnavailable)
        assert "client.max_restarts = 1" in str(health.error)
        assert engine.restarts == 1
        monitor.cancel()

    asyncio.run(scenario())


def make(server: FakeServer, again=(), cursors=None) -> Scheduler:
    config = OrchestratorConfig(
        model={"name": MODEL},
        batch_size=8,
        max_async_level=10,
        max_steps=100,
        max_failed_groups=1,
        envs=[{"id": "reverse-text", "group_size": 4}],
        client={"base_urls": [server.base_url]},
    )
    side = LocalEnvs(config)
    train, _ = side.load()
    pool = ServerPool(config.client)
    return Scheduler(config, train, pool, side, random.Random(0), cursors=cursors, again=again)


def test_groups_that_die_with_their_engine_go_again_and_do_not_count_as_failing_groups():
    async def scenario():
        with FakeServer(lambda req, i: Reply(status=500)) as server:
            sched = make(server)
            engine = DyingEngine()
            sched.pool.servers[0].engine = engine  # the server is "the engine": its death is seen
            sched.fill(step=0, policy_version=0)
            dispatched = [(g.env_name, g.example_id) for g in sched.inflight.values()]
            engine.stopped = True  # every request fails (500), as when the engine core dies
            while sched.inflight:  # max_failed_groups = 1: a counted failed group would raise here
                await sched.wait(timeout=5)
            assert sched.acc.buckets["failed"]["reverse-text"] == 4 * len(dispatched)
            # Dispatched again first, in the order they were lost (each finished in its own order).
            assert sorted((n, e.example_id) for n, e in sched.pending_examples()) == sorted(dispatched)
            sched.check_accounting()
            await sched.shutdown()
            await sched.env_side.close()

    asyncio.run(scenario())


def test_what_a_crash_would_lose_is_dispatched_first_by_the_next_orchestrator():
    async def scenario():
        with FakeServer(lambda req, i: Reply(delay_s=30)) as server:
            first = make(server)
            first.fill(step=0, policy_version=0)
            pending = first.pending_examples()
            assert len(pending) == len(first.inflight) > 0
            # The saved progress: the dataset cursors after these dispatches, and what they would lose.
            cursors = {name: source.cursor for name, source in first.examples.items()}
            await first.shutdown()
            await first.env_side.close()
            second = make(server, again=pending, cursors=cursors)
            second.fill(step=0, policy_version=0)
            again = [(g.env_name, g.example) for g in second.inflight.values()]
            assert again[: len(pending)] == pending
            await second.shutdown()
            await second.env_side.close()

    asyncio.run(scenario())


CHILD = """
import os, signal, sys, time
from prime_rl.runtime import activity, shutdown
shutdown.take_signals()
activity.start("parent", "orchestrator", sys.argv[1])
pid = os.fork()
if pid == 0:  # the child: vLLM's engine core, which takes SIGTERM its own way
    signal.signal(signal.SIGTERM, lambda *a: None)
    print("child record", activity._record is None, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    os._exit(0)
os.waitpid(pid, 0)
time.sleep(0.5)  # the parent's watcher would have read the child's signal by now
print("parent stopping", shutdown.stopping(), flush=True)
"""


def test_a_forked_child_neither_writes_its_parents_record_nor_stops_it_with_its_signals(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert "child record True" in out.stdout, out.stderr
    assert "parent stopping None" in out.stdout, out.stdout + out.stderr


def test_a_hung_engine_core_is_killed_alone_and_its_parent_lives(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
         "'import time; time.sleep(600)']); time.sleep(600)"],
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (children := [p for p in process_tree(parent.pid) if p != parent.pid]):
            assert time.monotonic() < deadline, "the child did not start"
            time.sleep(0.05)
        (core,) = children
        os.kill(core, signal.SIGSTOP)
        state = activity.State(
            activity.ENGINE_CORE, "inference", core, "h", activity.start_ticks(core), "generating", "", 0,
            0.0, False, 0, 0.0, 0.0, tmp_path / "x",
        )  # fmt: skip
        assert kill_culprit(state, {"orchestrator": parent.pid}, {"orchestrator": [parent.pid, core]}) is None
        while activity.alive(core):
            assert time.monotonic() < deadline, "the engine core was not killed"
            time.sleep(0.05)
        assert parent.poll() is None  # the orchestrator lives on, and restarts its engine
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
