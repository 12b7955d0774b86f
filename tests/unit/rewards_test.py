"""Reward functions run in worker threads, bounded and timed: a slow one does not stall the event
loop, and one that raises or times out fails its rollout with the reason (never a made-up 0.0)."""

import asyncio
import time

import pytest

from fake_server import FakeServer
from helpers.groups import run_groups as run_env_groups
from prime_rl.orchestrator.envs.rewards import RewardRunner
from prime_rl.orchestrator.envs_config import RewardsConfig


async def lag_probe(lags: list[float], stop: asyncio.Event, period: float = 0.005) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await asyncio.sleep(period)
        lags.append(time.perf_counter() - t - period)


def run_groups(server: FakeServer, env_args: dict, groups: int, size: int, runner: RewardRunner):
    """`groups` groups of `size` rollouts at once; returns their rollouts and the loop lags meanwhile."""
    lags, stop = [], asyncio.Event()
    probe = []

    def start_probe():
        probe.append(asyncio.ensure_future(lag_probe(lags, stop)))

    _, _, rollouts = run_env_groups(
        server.base_url,
        "slow_reward_env",
        env_args,
        size=size,
        groups=groups,
        runner=runner,
        on_loop=start_probe,
    )
    return rollouts, lags


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


def test_a_raising_reward_fails_the_rollout_with_the_reason():
    runner = RewardRunner(RewardsConfig())
    with FakeServer() as server:
        rollouts, _ = run_groups(server, {"mode": "raise"}, groups=1, size=4, runner=runner)
    runner.close()
    assert len(rollouts) == 4 and all(r.failed for r in rollouts)
    assert all(
        r.error == "reward error: reward function 'slow_reward' raised ValueError: judge said no"
        for r in rollouts
    )


def test_a_reward_past_its_timeout_fails_the_rollout_and_frees_nothing_early():
    runner = RewardRunner(RewardsConfig(concurrency=2, timeout_s=0.2))
    with FakeServer() as server:
        t = time.perf_counter()
        rollouts, _ = run_groups(server, {"mode": "hang", "seconds": 1.0}, groups=1, size=2, runner=runner)
        took = time.perf_counter() - t
    runner.close()
    assert all(r.failed and "timed out after 0.2s" in r.error for r in rollouts)
    assert took < 1.0  # the rollouts did not wait for the hung function


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

    async def go():
        await asyncio.gather(*(runner.call(reward, False, {"completion": "c"}) for _ in range(8)))

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
        for _ in range(n):
            assert await runner.call(reward, False, {"completion": "x"}) == 1.0

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
