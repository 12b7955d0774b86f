"""Reward functions run in worker threads, bounded and timed: a slow one does not stall the event
loop, and one that raises or times out fails its rollout with the reason (never a made-up 0.0)."""

import asyncio
import sys
import time

import pytest
import slow_reward_env
from server_health_test import wait_for as wait_until

from fake_server import FakeServer
from helpers.groups import run_groups as run_env_groups
from prime_rl.orchestrator.envs.rewards import GIL_SWITCH_S, RewardRunner
from prime_rl.orchestrator.envs_config import RewardsConfig


async def count_turns() -> None:
    """Count the event loop's turns where the env's rewards read them (until the loop ends)."""
    while True:
        slow_reward_env.LOOP_TURNS[0] += 1
        await asyncio.sleep(0.005)


def run_groups(server: FakeServer, env_args: dict, groups: int, size: int, runner: RewardRunner):
    """`groups` groups of `size` rollouts at once, with the event loop's turns counted meanwhile."""
    slow_reward_env.BURNS.clear()
    slow_reward_env.HUNG.clear()
    slow_reward_env.RELEASE.clear()
    _, _, rollouts = run_env_groups(
        server.base_url,
        "slow_reward_env",
        env_args,
        size=size,
        groups=groups,
        runner=runner,
        on_loop=lambda: asyncio.ensure_future(count_turns()),
    )
    return rollouts


def test_a_reward_burning_cpu_runs_beside_the_event_loop_not_on_it():
    # How little the loop lags meanwhile is benchmarks/orchestrator.py's to measure; here, that the
    # reward runs on a thread of its own while the loop goes on turning, and that the runner keeps
    # a burning thread from holding the GIL for long (sys.setswitchinterval).
    runner = RewardRunner(RewardsConfig())  # the defaults
    with FakeServer() as server:
        rollouts = run_groups(server, {"mode": "burn", "seconds": 0.05}, groups=4, size=8, runner=runner)
    runner.close()
    assert not any(r.failed for r in rollouts) and all(r.reward == 1.0 for r in rollouts)
    burns = slow_reward_env.BURNS
    assert len(burns) == 32 and all(thread.startswith("reward") for thread, _ in burns), burns
    # On the loop's thread a reward would see no turn at all: the loop cannot turn during a call.
    assert sum(turns for _, turns in burns) > 0, burns
    assert sys.getswitchinterval() <= GIL_SWITCH_S


def test_a_raising_reward_fails_the_rollout_with_the_reason():
    runner = RewardRunner(RewardsConfig())
    with FakeServer() as server:
        rollouts = run_groups(server, {"mode": "raise"}, groups=1, size=4, runner=runner)
    runner.close()
    assert len(rollouts) == 4 and all(r.failed for r in rollouts)
    assert all(
        r.error == "reward error: reward function 'slow_reward' raised ValueError: judge said no"
        for r in rollouts
    )


def test_a_reward_past_its_timeout_fails_the_rollout_and_frees_nothing_early():
    runner = RewardRunner(RewardsConfig(concurrency=2, timeout_s=0.2))
    try:
        with FakeServer() as server:
            # Hung until released (the 60 s only bound a test that fails).
            rollouts = run_groups(server, {"mode": "hang", "seconds": 60}, groups=1, size=2, runner=runner)
        assert all(r.failed and "timed out after 0.2s" in r.error for r in rollouts)
        assert slow_reward_env.HUNG == []  # the rollouts did not wait for the hung function
    finally:
        slow_reward_env.RELEASE.set()
        runner.close()
    wait_until(lambda: len(slow_reward_env.HUNG) == 2, "the released rewards to return")


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
