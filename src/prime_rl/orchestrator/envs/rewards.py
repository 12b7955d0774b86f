"""Reward functions run off the event loop, under a concurrency bound and a timeout.

verifiers calls a rubric's plain (sync) functions on the caller's event loop, and turns a raising one
into reward 0.0 with a log line. Here every function of an env's rubric is replaced, once, at load
time, by a wrapper with the same name and signature (so verifiers' argument selection and group
detection see the original) that:

- runs a sync function in a worker thread of a pool shared by all envs, off the event loop, until
  it has shown itself too fast for the thread hop to pay (`inline_below_ms`); an async one on the
  loop (it awaits its I/O; an async function that computes without awaiting still blocks the
  loop: make it sync);
- holds one of `concurrency` slots from the start of the call until the function really returns,
  so a function that timed out keeps its slot while its thread still runs, and the timeout measures
  the function's own time, not the queue before it;
- on a timeout or an exception, records the reason in the rollout's state under `REWARD_ERROR`
  (every state of the group for a group function) and re-raises, so that the adapter turns the
  rollout into a failed one with that reason instead of training on a made-up 0.0.

Invariant: a rollout whose reward could not be computed never trains.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prime_rl.orchestrator.envs_config import RewardsConfig

REWARD_ERROR = "prime_rl_reward_error"
"""State key (and requested state column) that carries why a reward function failed."""


INLINE_AFTER = 32
"""Calls, each faster than `inline_below_ms`, after which a plain reward function runs inline."""

GIL_SWITCH_S = 0.001
"""The interpreter's thread switch interval while a runner exists (Python's default is 5 ms)."""


class RewardRunner:
    """Runs wrapped reward functions; one per orchestrator, shared by its envs."""

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
        timing = self._timings.get(func)
        if timing is None:
            timing = self._timings[func] = _Timing(self.config.inline_below_ms / 1000)
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

    def wrap(self, func, group: bool | None = None):
        """`func` as an async function with its name and signature, run as described above.
        `group`: whether verifiers calls it once per group (default: verifiers' own rule)."""
        if getattr(func, "_prime_rl_wrapped", False):
            return func
        sig = inspect.signature(func)
        params = sig.parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
        name = getattr(func, "__name__", repr(func))
        is_async = inspect.iscoroutinefunction(func)
        # We need the state(s) to record a failure; the function gets them only if it asked.
        group = _is_group(sig) if group is None else group
        key = "states" if group else "state"
        own_key = takes_any or key in params
        extra = [] if key in params else [inspect.Parameter(key, inspect.Parameter.KEYWORD_ONLY)]
        positional = [p for p in params.values() if p.kind is not p.VAR_KEYWORD]
        var_kw = [p for p in params.values() if p.kind is p.VAR_KEYWORD]
        ordered = sorted(positional + extra, key=lambda p: p.kind)
        timeout = self.config.timeout_s

        async def wrapper(**kwargs):
            states = kwargs.get(key)
            call_kwargs = kwargs if own_key else {k: v for k, v in kwargs.items() if k != key}
            try:
                return await self.call(func, is_async, call_kwargs)
            except TimeoutError:
                _record(states, group, f"reward function '{name}' timed out after {timeout:g}s")
                raise
            except Exception as e:
                _record(states, group, f"reward function '{name}' raised {type(e).__name__}: {e}")
                raise

        wrapper.__name__ = name
        wrapper.__qualname__ = getattr(func, "__qualname__", name)
        wrapper.__doc__ = func.__doc__
        wrapper.__signature__ = sig.replace(parameters=ordered + var_kw)
        wrapper._prime_rl_wrapped = True
        return wrapper

    def install(self, vf_env) -> None:
        """Wrap every reward and metric function of the env's rubric tree, in place (once per env)."""
        for rubric in rubrics(getattr(vf_env, "rubric", None)):
            funcs = getattr(rubric, "funcs", None)
            if isinstance(funcs, list):
                is_group = getattr(rubric, "_is_group_func", None)
                funcs[:] = [self.wrap(f, is_group(f) if is_group else None) for f in funcs]


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


def _is_group(sig: inspect.Signature) -> bool:
    # verifiers' rule (Rubric._is_group_func), for a function wrapped outside a rubric.
    plural = {"completions", "prompts", "answers", "states", "tasks", "infos"}
    ret = sig.return_annotation
    return bool(plural & set(sig.parameters)) or ret is list or getattr(ret, "__origin__", None) is list


def _record(states, group: bool, reason: str) -> None:
    for state in (states or []) if group else [states]:
        if isinstance(state, dict) and not state.get(REWARD_ERROR):
            state[REWARD_ERROR] = reason


def rubrics(rubric):
    """Every rubric of a rubric tree: itself, its children, and the rubrics of an EnvGroup's envs."""
    if rubric is None:
        return
    yield rubric
    for child in getattr(rubric, "rubrics", None) or []:
        yield from rubrics(child)
    for env in (getattr(rubric, "env_map", None) or {}).values():  # an EnvGroup routes to its envs
        yield from rubrics(getattr(env, "rubric", None))
