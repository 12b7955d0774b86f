"""Reward functions run off the event loop, under a concurrency bound and a timeout
(`RewardRunner.call`, used by `scoring.py` for every scoring hook):

- a sync function runs in a worker thread of a pool shared by all envs, off the event loop, until
  it has shown itself too fast for the thread hop to pay (`inline_below_ms`); an async one on the
  loop (it awaits its I/O; an async function that computes without awaiting still blocks the
  loop: make it sync);
- a call holds one of `concurrency` slots from its start until the function really returns, so a
  function that timed out keeps its slot while its thread still runs, and the timeout measures
  the function's own time, not the queue before it.

Invariant: a call that raises or runs past `timeout_s` raises to the caller (`TimeoutError` for
the latter): a rollout whose reward could not be computed never trains.
"""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prime_rl.orchestrator.envs_config import RewardsConfig

INLINE_AFTER = 32
"""Calls, each faster than `inline_below_ms`, after which a plain reward function runs inline."""

GIL_SWITCH_S = 0.001
"""The interpreter's thread switch interval while a runner exists (Python's default is 5 ms)."""


class RewardRunner:
    """Runs reward functions; one per orchestrator, shared by its envs."""

    def __init__(self, config: RewardsConfig):
        self.config = config
        # A reward thread computing in Python holds the GIL for a whole switch interval each time the
        # loop thread wants it back, and the loop wants it after every socket call: at 5 ms, two
        # threads of a 50 ms reward gave 36 ms p99 loop lag and slowed generation 5x; at 1 ms, 19 ms
        # and no slowdown (the setup of tests/unit/rewards_test.py).
        sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
        self._executor = ThreadPoolExecutor(config.concurrency, thread_name_prefix="reward")
        self._slots: asyncio.Semaphore | None = None  # made on the loop that uses it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timings: dict[Any, _Timing] = {}

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _call_sync(self, func, kwargs: dict[str, Any]) -> Any:
        key = getattr(func, "__func__", func)  # a method: one timing for all of its instances
        timing = self._timings.get(key)
        if timing is None:
            timing = self._timings[key] = _Timing(self.config.inline_below_ms / 1000)
        if timing.inline:
            t0 = time.perf_counter()
            try:
                return func(**kwargs)
            finally:
                timing.record(time.perf_counter() - t0)
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            self._slots, self._loop = asyncio.Semaphore(self.config.concurrency), loop
        slots = self._slots
        await slots.acquire()
        try:
            future = self._executor.submit(_timed, timing, func, kwargs)
        except BaseException:
            slots.release()
            raise

        def free(_) -> None:  # the slot frees when the thread is done, not when we stop waiting for it
            if not loop.is_closed():
                loop.call_soon_threadsafe(slots.release)

        future.add_done_callback(free)
        return await asyncio.wait_for(asyncio.wrap_future(future), self.config.timeout_s)

    async def call(self, func, is_async: bool, kwargs: dict[str, Any]) -> Any:
        if is_async:
            return await asyncio.wait_for(func(**kwargs), self.config.timeout_s)
        return await self._call_sync(func, kwargs)


class _Timing:
    """Whether one reward function is fast enough to run inline (see `inline_below_ms`)."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.fast_calls = 0
        self.slow = limit_s <= 0

    @property
    def inline(self) -> bool:
        return not self.slow and self.fast_calls >= INLINE_AFTER

    def record(self, seconds: float) -> None:
        if seconds >= self.limit_s:
            self.slow = True  # for good: one slow call shows the function can be slow
        else:
            self.fast_calls += 1


def _timed(timing: _Timing, func, kwargs: dict[str, Any]) -> Any:
    t0 = time.perf_counter()
    try:
        return func(**kwargs)
    finally:
        timing.record(time.perf_counter() - t0)
