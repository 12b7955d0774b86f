"""Scheduler semantics that need control over time: policy lag, stale cancellation, weight sync."""

import asyncio
import random

from fake_server import MODEL, FakeServer, Reply
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs.local import LocalEnvs
from prime_rl.orchestrator.loop.scheduler import Scheduler
from prime_rl.orchestrator.loop.servers import ServerPool
from prime_rl.orchestrator.loop.weights import WeightSync
from prime_rl.runtime.layout import READY


def make(server: FakeServer, **overrides) -> Scheduler:
    config = OrchestratorConfig(
        **{
            "model": {"name": MODEL},
            "batch_size": 8,
            "max_async_level": 1,
            "max_steps": 100,
            "envs": [{"id": "reverse-text", "group_size": 4}],
            "client": {"base_urls": [server.base_url]},
            **overrides,
        }
    )
    side = LocalEnvs(config)
    train, _ = side.load()
    return Scheduler(config, train, ServerPool(config.client), side, random.Random(0))


async def close(sched: Scheduler) -> None:
    # The env side too: its reward threads (non-daemon: they would outlive the test) and clients.
    await sched.shutdown()
    await sched.env_side.close()


def test_generation_runs_ahead_by_at_most_max_async_level_steps():
    async def scenario():
        with FakeServer(lambda req, i: Reply(delay_s=5)) as server:
            for level in (0, 1, 2):
                sched = make(server, max_async_level=level)
                sched.fill(step=0, policy_version=0)
                # batch 8 = two groups of 4 per step: steps 0..level may be in flight at version 0.
                assert sched.inflight_rollouts == 8 * (level + 1)
                sched.fill(step=0, policy_version=1)
                assert sched.inflight_rollouts == 8 * (level + 2)
                await close(sched)

    asyncio.run(scenario())


def test_in_flight_limit_is_respected():
    async def scenario():
        with FakeServer(lambda req, i: Reply(delay_s=5)) as server:
            sched = make(server, max_async_level=10, max_inflight_rollouts=12)
            sched.fill(step=0, policy_version=0)
            assert sched.inflight_rollouts == 12 and sched.pool.inflight == 12
            await close(sched)

    asyncio.run(scenario())


def test_stale_groups_are_cancelled_and_counted():
    async def scenario():
        with FakeServer(lambda req, i: Reply(delay_s=30)) as server:
            sched = make(server, max_async_level=1)
            sched.fill(step=0, policy_version=0)
            tasks = list(sched.inflight)
            assert sched.inflight_rollouts == 16
            # Step 2 may still train them (one step later than planned: 2 - 0 <= 1 + 1), step 3 not.
            assert sched.drop_stale(step=2) == 0 and sched.inflight_rollouts == 16
            dropped = sched.drop_stale(step=3)
            assert dropped == 16 and sched.inflight_rollouts == 0
            await asyncio.sleep(0)
            assert all(t.cancelled() or t.cancelling() for t in tasks)
            assert sched.acc.buckets["stale"]["reverse-text"] == 16
            sched.check_accounting()
            await close(sched)

    asyncio.run(scenario())


def test_finished_groups_become_stale_too():
    async def scenario():
        with FakeServer() as server:
            sched = make(server, max_async_level=0)
            sched.fill(step=0, policy_version=0)
            while sched.inflight:
                await sched.wait(timeout=5)
            assert sched.ready_rollouts == 8
            assert sched.drop_stale(step=1) == 8
            sched.check_accounting()
            await close(sched)

    asyncio.run(scenario())


def test_weight_sync_loads_the_newest_ready_step_on_every_server(tmp_path):
    async def scenario():
        with FakeServer() as a, FakeServer() as b:
            config = OrchestratorConfig(model={"name": MODEL}, client={"base_urls": [a.base_url, b.base_url]})
            sync = WeightSync(tmp_path, ServerPool(config.client))
            assert await sync.poll() == 0 and not a.loads
            for step in (1, 2, 3):
                (tmp_path / f"step_{step}").mkdir()
            (tmp_path / "step_1" / READY).touch()
            (tmp_path / "step_2" / READY).touch()  # step 3 is still being written: no marker
            assert await sync.poll() == 2
            for server in (a, b):
                assert [x["step"] for x in server.loads] == [2]
                assert server.loads[0]["path"].endswith("step_2")
            assert await sync.poll() == 2 and len(a.loads) == 1  # nothing new: no reload

    asyncio.run(scenario())


def test_the_off_policy_bound_defaults_to_one_step_more_than_the_async_level():
    assert OrchestratorConfig(max_async_level=0).off_policy_bound == 0  # synchronous stays on-policy
    assert OrchestratorConfig(max_async_level=1).off_policy_bound == 2
    assert OrchestratorConfig(max_async_level=1, max_off_policy_steps=1).off_policy_bound == 1

    async def scenario():
        with FakeServer(lambda req, i: Reply(delay_s=30)) as server:
            sched = make(server, max_async_level=1, max_off_policy_steps=1)
            sched.fill(step=0, policy_version=0)
            assert sched.drop_stale(step=2) == 16
            await close(sched)

    asyncio.run(scenario())
