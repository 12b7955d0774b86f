"""Reward functions run in worker threads, bounded and timed: a slow one does not stall the event
loop, and one that raises or times out fails its rollout with the reason (never a made-up 0.0)."""

import asyncio
import time

import pytest

from fake_server import FakeServer
from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.envs.client import Clients
from prime_rl.orchestrator.envs.group_runner import GroupRun, run_group
from prime_rl.orchestrator.envs.load import load_env, rollout_input
from prime_rl.orchestrator.envs.rewards import RewardRunner
from prime_rl.orchestrator.envs_config import EnvConfig, RewardsConfig, SamplingConfig
from prime_rl.orchestrator.loop.examples import ExampleSource


async def lag_probe(lags: list[float], stop: asyncio.Event, period: float = 0.005) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(time.perf_counter() - t - period)


def run_groups(server: FakeServer, env_args: dict, groups: int, size: int, runner: RewardRunner | None):
    """`groups` groups of `size` rollouts at once; returns their rollouts and the loop lags meanwhile."""
    env = load_env(EnvConfig(id="slow_reward_env", args=env_args, group_size=size), rewards=runner)
    examples = ExampleSource(env.dataset, 0)
    jobs = []
    for _ in range(groups):
        row = examples.next()
        jobs.append(
            GroupRun(env.name, env.vf_env, rollout_input(row), row["example_id"], size, 0, SamplingConfig())
        )

    async def go():
        lags, stop = [], asyncio.Event()
        probe = asyncio.create_task(lag_probe(lags, stop))
        client = Clients(ClientConfig(base_urls=[server.base_url])).get(server.base_url)
        out = await asyncio.gather(*(run_group(job, client, server.base_url, "m", 30.0) for job in jobs))
        stop.set()
        await probe
        return [r for group in out for r in group], lags

    return asyncio.run(go())


def p99(values: list[float]) -> float:
    return sorted(values)[int(0.99 * (len(values) - 1))]


def test_a_reward_burning_50ms_of_cpu_per_rollout_keeps_loop_lag_under_50ms():
    runner = RewardRunner(RewardsConfig())  # the defaults
    with FakeServer() as server:
        rollouts, lags = run_groups(
            server, {"mode": "burn", "seconds": 0.05}, groups=4, size=8, runner=runner
        )
    runner.close()
    assert not any(r.failed for r in rollouts) and all(r.reward == 1.0 for r in rollouts)
    assert len(lags) > 20  # the probe ran throughout the ~1.6 s of scoring
    assert p99(lags) < 0.05, f"p99 loop lag {p99(lags) * 1e3:.1f} ms"


def test_without_the_runner_the_same_reward_stalls_the_loop():
    # The measurement above can fail: verifiers alone runs the reward on the loop.
    with FakeServer() as server:
        _, lags = run_groups(server, {"mode": "burn", "seconds": 0.05}, groups=1, size=8, runner=None)
    assert max(lags) >= 0.045


def test_a_raising_reward_fails_the_rollout_with_the_reason():
    runner = RewardRunner(RewardsConfig())
    with FakeServer() as server:
        rollouts, _ = run_groups(server, {"mode": "raise"}, groups=1, size=4, runner=runner)
    runner.close()
    assert len(rollouts) == 4 and all(r.failed for r in rollouts)
    assert all("slow_reward" in r.error and "ValueError: judge said no" in r.error for r in rollouts)


def test_a_reward_past_its_timeout_fails_the_rollout_and_frees_nothing_early():
    runner = RewardRunner(RewardsConfig(concurrency=2, timeout_s=0.2))
    with FakeServer() as server:
        t = time.perf_counter()
        rollouts, _ = run_groups(server, {"mode": "hang", "seconds": 1.0}, groups=1, size=2, runner=runner)
        took = time.perf_counter() - t
    runner.close()
    assert all(r.failed and "timed out after 0.2s" in r.error for r in rollouts)
    assert took < 1.0  # the rollouts did not wait for the hung function


def test_the_wrapper_keeps_verifiers_view_of_the_function():
    runner = RewardRunner(RewardsConfig())

    def per_rollout(completion, answer) -> float:
        return 1.0

    def per_group(completions, states) -> list[float]:
        return [1.0] * len(completions)

    import inspect

    import verifiers as vf

    rubric = vf.Rubric(funcs=[per_rollout, per_group])
    wrapped = [runner.wrap(f, rubric._is_group_func(f)) for f in rubric.funcs]
    assert [w.__name__ for w in wrapped] == ["per_rollout", "per_group"]
    assert [rubric._is_group_func(w) for w in wrapped] == [False, True]
    # The state is passed so that a failure can be recorded, and is not passed on to the function.
    assert list(inspect.signature(wrapped[0]).parameters) == ["completion", "answer", "state"]
    assert list(inspect.signature(wrapped[1]).parameters) == ["completions", "states"]
    state = {}
    assert asyncio.run(wrapped[0](completion="x", answer="y", state=state)) == 1.0 and state == {}
    runner.close()


@pytest.mark.parametrize("concurrency", [1, 3])
def test_no_more_than_concurrency_reward_calls_run_at_once(concurrency):
    runner = RewardRunner(RewardsConfig(concurrency=concurrency))
    running, peak = 0, 0
    import threading

    lock = threading.Lock()

    def reward(completion) -> float:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.02)
        with lock:
            running -= 1
        return 1.0

    wrapped = runner.wrap(reward, False)

    async def go():
        await asyncio.gather(*(wrapped(completion="c", state={}) for _ in range(8)))

    asyncio.run(go())
    runner.close()
    assert peak == concurrency


def test_a_fast_reward_runs_inline_after_32_fast_calls_and_a_slow_call_sends_it_back_to_threads():
    import threading

    from prime_rl.orchestrator.envs.rewards import INLINE_AFTER

    seen, delay = [], [0.0]

    def reward(completion, **kwargs) -> float:
        seen.append(threading.current_thread() is threading.main_thread())
        time.sleep(delay[0])
        return 1.0

    async def calls(runner, n: int) -> None:
        wrapped = runner.wrap(reward)
        for _ in range(n):
            assert await wrapped(completion="x", state={}) == 1.0

    runner = RewardRunner(RewardsConfig(inline_below_ms=50))
    asyncio.run(calls(runner, INLINE_AFTER + 3))
    assert seen == [False] * INLINE_AFTER + [True] * 3  # threads until it has shown itself fast
    seen.clear()
    delay[0] = 0.06  # slower than the limit once: back to the threads for good
    asyncio.run(calls(runner, 1))
    delay[0] = 0.0
    asyncio.run(calls(runner, INLINE_AFTER + 3))
    assert seen == [True] + [False] * (INLINE_AFTER + 3)
    runner.close()

    seen.clear()
    never = RewardRunner(RewardsConfig(inline_below_ms=0))
    asyncio.run(calls(never, INLINE_AFTER + 3))
    assert not any(seen)
    never.close()
