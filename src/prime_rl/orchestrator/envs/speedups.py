"""Cut the CPU that verifiers' classic rollout machinery spends per rollout, without changing what it
computes.

verifiers calls `inspect.signature` on every stop condition, reward function and cleanup handler of
every rollout, to pass each only the arguments it names: about 24 calls per single-turn rollout,
~0.4 ms of CPU (measured with `benchmarks/orchestrator.py`). A function's signature does not change
while a run lasts, so it is computed once per function here and reused.

Invariant: `signature(f)` equals `inspect.signature(f)` for every callable; it is cached only for
plain functions and methods bound to them (keyed weakly by the function, so nothing is kept alive),
and a function whose `__signature__` or `__wrapped__` is set after its first call is a known
limit (none of verifiers' decorators do that).
"""

from __future__ import annotations

import inspect
import os
import types
import weakref

_plain: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_bound: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def signature(func) -> inspect.Signature:
    if isinstance(func, types.FunctionType):
        cache, key = _plain, func
    elif isinstance(func, types.MethodType) and isinstance(func.__func__, types.FunctionType):
        cache, key = _bound, func.__func__
    else:
        return inspect.signature(func)
    sig = cache.get(key)
    if sig is None:
        sig = cache[key] = inspect.signature(func)
    return sig


class _CachedInspect(types.ModuleType):
    """`inspect` as seen by the patched modules: the same, with a cached `signature`."""

    def __getattr__(self, name):
        return getattr(inspect, name)


_inspect = _CachedInspect("inspect")
_inspect.signature = signature


def enabled() -> bool:
    """`PRIME_RL_VERIFIERS_SPEEDUPS=0` turns the speed-ups off (the cached signatures, the direct
    POST with its own request merging, inline fast rewards): an escape hatch should one ever change
    what an env computes, and the "before" of `benchmarks/orchestrator.py`."""
    return os.environ.get("PRIME_RL_VERIFIERS_SPEEDUPS", "1") != "0"


def speed_up_verifiers() -> None:
    """Give verifiers' per-rollout call sites the cached `signature`, or, when the speed-ups are
    off, their own `inspect` back (idempotent)."""
    from verifiers.legacy.rubrics import rubric
    from verifiers.legacy.utils import async_utils

    for module in (async_utils, rubric):
        if getattr(module, "inspect", None) in (inspect, _inspect):
            module.inspect = _inspect if enabled() else inspect
