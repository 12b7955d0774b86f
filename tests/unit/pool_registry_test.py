"""The pool's door, against fake servers: a server that registers with the run secret becomes a
member once loaded with the current weights; one without it is refused (401, one line) and changes
nothing; one that leaves gets no new group, its groups in flight finish or are handed back, and it is
removed (a reload it fails while it leaves is its leaving, not the run's end); `inference
--pool.join` finds the door in the run folder; the step line shows the pool."""

import asyncio
import json
import random
import threading
from pathlib import Path

import httpx
import pytest

from fake_server import MODEL, FakeServer, Reply
from prime_rl.auth import clients
from prime_rl.inference.config import InferenceConfig
from prime_rl.inference.member import Member, door
from prime_rl.orchestrator.config import OrchestratorConfig, PoolConfig
from prime_rl.orchestrator.envs.local import LocalEnvs
from prime_rl.orchestrator.loop.health import ServerHealth
from prime_rl.orchestrator.loop.registry import Registry
from prime_rl.orchestrator.loop.scheduler import Scheduler
from prime_rl.orchestrator.loop.servers import ServerPool
from prime_rl.orchestrator.loop.step_metrics import pool_metrics, pool_part
from prime_rl.orchestrator.loop.weights import WeightSync, WeightSyncError
from prime_rl.runtime import secret
from prime_rl.runtime.layout import READY, pool_path
from prime_rl.runtime.net import free_port

RUN_SECRET = "the-runs-secret-0123456789abcdef"


@pytest.fixture
def run_secret(monkeypatch):
    monkeypatch.setenv(secret.ENV, RUN_SECRET)
    secret.value.cache_clear()
    yield
    secret.value.cache_clear()


def publish(run: Path, step: int) -> None:
    d = run / "weights" / f"step_{step}"
    d.mkdir(parents=True)
    (d / READY).touch()


async def pool_with(first: FakeServer, run: Path, batch_size: int = 8):
    config = OrchestratorConfig(
        model={"name": MODEL},
        output_dir=run,
        batch_size=batch_size,
        max_async_level=10,
        max_steps=100,
        envs=[{"id": "reverse-text", "group_size": 4}],
        client={"base_urls": [first.base_url], "health_interval_s": 0.05},
    )
    side = LocalEnvs(config)
    train, _ = side.load()
    pool = ServerPool(config.client)
    weights = WeightSync(run / "weights", pool, version=0)
    sched = Scheduler(config, train, pool, side, random.Random(0))
    registry = Registry(PoolConfig(max_drain_s=5), pool, weights, run, sched.abandon)
    health = ServerHealth(pool, weights, 0.05, 60, on_silent=sched.abandon)
    return pool, weights, sched, registry, health


def test_a_server_joins_with_the_secret_loaded_with_the_current_weights_and_one_without_is_refused(
    tmp_path, run_secret
):
    async def scenario():
        run = tmp_path / "run"
        with (
            FakeServer(weights_dir=str(run / "weights")) as first,
            FakeServer(weights_dir=str(run / "weights")) as second,
        ):
            pool, weights, sched, registry, health = await pool_with(first, run)
            publish(run, 3)
            await weights.poll()  # the run is at step 3
            url = await registry.start()
            assert json.loads(pool_path(run).read_text()) == {"url": url}
            monitor = asyncio.create_task(health.run())
            async with httpx.AsyncClient(base_url=url) as http:
                for forged in ({"Authorization": f"Bearer {run_secret}"}, {}):  # the secret itself, nothing
                    refused = await http.post("/pool/join", json={"url": second.base_url}, headers=forged)
                    assert refused.status_code == 401 and "pool takes only" in refused.json()["error"]
                assert len(pool.servers) == 1  # nothing changed
                ok = await http.post("/pool/join", json={"url": second.base_url}, auth=clients.auth())
                assert ok.status_code == 200 and ok.json() == {"step": 3}
                member = pool.find(second.base_url)
                assert member is not None and not member.up  # no work before it serves step 3
                while not member.up:
                    await asyncio.sleep(0.02)
                assert [load["step"] for load in second.loads] == [3] and member.step == 3
                listed = (await http.get("/pool", auth=clients.auth())).json()
                assert {m["url"]: m["state"] for m in listed["members"]} == {
                    first.base_url: "serving",
                    second.base_url: "serving",
                }
            monitor.cancel()
            await registry.close(finished=True)
            assert json.loads(pool_path(run).read_text()) == {"url": url, "finished": True}
            await sched.shutdown()
            await sched.env_side.close()

    asyncio.run(scenario())


def test_a_leaving_server_gets_no_new_group_and_its_groups_in_flight_are_handed_back(tmp_path, run_secret):
    async def scenario():
        run = tmp_path / "run"
        slow = FakeServer(lambda req, i: Reply(delay_s=30), weights_dir=str(run / "weights"))
        with slow as first, FakeServer(weights_dir=str(run / "weights")) as second:
            pool, _, sched, registry, _ = await pool_with(first, run, batch_size=64)
            url = await registry.start()
            sched.fill(step=0, policy_version=0)
            on_first = [(g.env_name, g.example_id) for g in sched.inflight.values()]
            assert on_first and pool.servers[0].inflight > 0
            pool.join(second.base_url)  # a second member, up, takes the new groups
            pool.servers[1].up, pool.servers[1].joining = True, False
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                left = await http.post(
                    "/pool/leave", json={"url": first.base_url, "drain_s": 0.2}, auth=clients.auth()
                )
            assert left.status_code == 200 and left.json()["handed_back"] == len(on_first)
            assert pool.servers == [pool.find(second.base_url)]
            # Handed back: failed (counted) and dispatched again first, on the server that stays.
            assert sorted((n, e.example_id) for n, e in sched.pending_examples()) == sorted(on_first)
            sched.fill(step=0, policy_version=0)
            assert all(g.server.base_url == second.base_url for g in sched.inflight.values())
            sched.check_accounting()
            await registry.close()
            await sched.shutdown()
            await sched.env_side.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("leaves", [True, False], ids=["leaving", "staying"])
def test_a_server_that_fails_a_reload_while_it_leaves_is_left_behind_and_one_that_stays_stops_the_run(
    tmp_path, leaves
):
    """The race seen in a real run: a server stopped while a reload is in flight answers 500 (its
    engine is going); it has left meanwhile, so the others load on. The same 500 from a member
    that stays is a server that cannot load this run's weights: the run stops, naming it."""

    async def scenario():
        run = tmp_path / "run"
        hold = threading.Event()
        going = FakeServer(weights_dir=str(run / "weights"), load_status=500, hold_loads=hold)
        with FakeServer(weights_dir=str(run / "weights")) as first, going as second:
            pool, weights, _, _, _ = await pool_with(first, run)
            member = pool.join(second.base_url)
            member.up, member.joining = True, False
            publish(run, 1)
            poll = asyncio.create_task(weights.poll())
            while not second.loads:  # the reload reached it
                await asyncio.sleep(0.01)
            if leaves:
                pool.remove(member)
            hold.set()
            try:
                if leaves:
                    assert await poll == 1  # the run is at step 1, on the server that stays
                    assert [load["step"] for load in first.loads] == [1]
                else:
                    with pytest.raises(
                        WeightSyncError, match=rf"{second.port}.* refused to load .* step 1 \(500\)"
                    ):
                        await poll
            finally:
                hold.set()

    asyncio.run(scenario())


def test_inference_finds_the_door_in_the_run_folder_and_says_when_it_is_not_there(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"orchestrator\.pool"):
        door(str(tmp_path))
    pool_path(tmp_path).parent.mkdir(parents=True)
    pool_path(tmp_path).write_text(json.dumps({"url": "http://10.0.0.1:4242"}))
    assert door(str(tmp_path)) == "http://10.0.0.1:4242"
    assert door("http://10.0.0.2:1/") == "http://10.0.0.2:1"
    config = InferenceConfig(server={"host": "0.0.0.0", "port": 8123}, pool={"join": str(tmp_path)})
    assert Member(config).url.endswith(":8123") and "0.0.0.0" not in Member(config).url


def test_the_step_line_shows_the_pool_once_it_has_more_than_one_member():
    class S:
        def __init__(self, name, state, groups, step):
            self.name, self.state, self.groups, self.step = name, state, groups, step

    one = pool_metrics([S("engine", "serving", 16, 3)], {})
    assert pool_part(one) == ""
    two = pool_metrics([S("engine", "serving", 30, 3), S("h:1", "joining", 0, None)], {"engine": 14})
    assert two["pool/engine/groups"] == 16 and "pool/h:1/step" not in two
    assert pool_part(two) == " | pool 1 serving, 1 joining (groups: engine 16, h:1 0)"


def test_a_server_that_joined_and_vanished_leaves_the_pool_after_silent_s(tmp_path):
    """One of `client.base_urls` that vanishes stays a member (`rl` restarts it at its address); one
    that joined is removed once silent for `client.silent_s`: it comes back by registering again,
    maybe at another address."""

    async def scenario():
        with FakeServer() as first:
            pool = ServerPool(OrchestratorConfig(client={"base_urls": [first.base_url]}).client)
            weights = WeightSync(tmp_path / "weights", pool, version=0)
            lost = []
            health = ServerHealth(
                pool, weights, 0.05, 60, silent_s=0.3, on_silent=lambda s: lost.append(s) or 0
            )
            gone = pool.join(f"http://127.0.0.1:{free_port()}/v1")  # nothing listens there
            monitor = asyncio.create_task(health.run())
            while gone in pool.servers:
                await asyncio.sleep(0.02)
            assert lost == [gone] and gone.left and gone.lost
            assert pool.servers == [pool.find(first.base_url)] and health.error is None
            monitor.cancel()

    asyncio.run(scenario())
