"""The loop in engine mode (`orchestrator.engine`): its one server is vLLM's engine in this process,
which says its own served step, loads weights by a call, is never polled over HTTP, and stops the
run with one line once it cannot serve. The engine here is a stand-in with `LocalEngine`'s surface
(the real one is exercised by tests/integration/engine_test.py and rl_test.py)."""

import asyncio
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from prime_rl.engine.local import BROKEN, EngineBroken
from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.loop.health import ServerHealth
from prime_rl.orchestrator.loop.servers import ENGINE_URL, InferenceUnavailable, ServerPool
from prime_rl.orchestrator.loop.weights import WeightSync, WeightSyncError, served_step
from prime_rl.orchestrator.loop.weights_dir import check_weights_dirs
from prime_rl.runtime.layout import READY, step_dir, weights_root

# Nothing listens at these: a request to one would fail (and the test with it).
UNREACHABLE = ClientConfig(base_urls=["http://127.0.0.1:9/v1"], health_timeout_s=0.5)


@dataclass
class Engine:
    step: int = 0
    broken: bool = False
    stopped: bool = False
    fail: bool = False
    loads: list[tuple[Path, int]] = field(default_factory=list)

    @property
    def served_step(self) -> int:
        return BROKEN if self.broken else self.step

    async def load_weights(self, path: Path, step: int):
        self.loads.append((path, step))
        if self.fail:
            self.broken = True
            raise EngineBroken(f"loading {path} failed midway: OSError: disk")
        self.step = step


def publish(output_dir: Path, step: int) -> Path:
    folder = step_dir(weights_root(output_dir), step)
    folder.mkdir(parents=True)
    (folder / READY).touch()
    return folder


def test_the_pool_is_the_engine_and_no_server_is_asked_anything(tmp_path):
    engine = Engine()
    pool = ServerPool(UNREACHABLE, engine)
    [server] = pool.servers
    assert server.engine is engine and server.base_url == ENGINE_URL
    # Neither health nor the weights folder is asked of the unreachable URLs of client.base_urls.
    asyncio.run(pool.wait_healthy())
    asyncio.run(check_weights_dirs(pool, tmp_path, adapter=False))
    assert asyncio.run(served_step(None, server)) == 0


def test_new_weights_load_by_a_call_on_the_engine(tmp_path):
    engine = Engine()
    pool = ServerPool(UNREACHABLE, engine)
    sync = WeightSync(weights_root(tmp_path), pool)
    folder = publish(tmp_path, 3)
    assert asyncio.run(sync.poll()) == 3
    assert engine.loads == [(folder.resolve(), 3)] and engine.served_step == 3


def test_a_load_that_breaks_the_engine_is_a_weight_sync_error_naming_the_step(tmp_path):
    engine = Engine(fail=True)
    sync = WeightSync(weights_root(tmp_path), ServerPool(UNREACHABLE, engine))
    publish(tmp_path, 1)
    with pytest.raises(WeightSyncError, match=r"could not load step 1: loading .* failed midway"):
        asyncio.run(sync.poll())
    assert sync.version == 0 and engine.served_step == BROKEN


def test_an_engine_that_stopped_stops_the_run_with_one_line(tmp_path):
    engine = Engine()
    pool = ServerPool(UNREACHABLE, engine)
    health = ServerHealth(pool, WeightSync(weights_root(tmp_path), pool), interval_s=0.01, give_up_s=60)

    async def watch() -> None:
        task = asyncio.create_task(health.run())
        await asyncio.sleep(0)
        health.raise_if_failed()  # serving: nothing to say
        engine.stopped = True
        pool.suspect(pool.servers[0])  # a failed group wakes the monitor

        async def said() -> None:
            while health.error is None:
                await asyncio.sleep(0.01)

        try:
            await asyncio.wait_for(said(), 60)  # a deadline only for a monitor that never says it
        finally:
            task.cancel()

    asyncio.run(watch())
    with pytest.raises(InferenceUnavailable, match="vLLM's engine in this process stopped"):
        health.raise_if_failed()
