"""What every reward function shares: its config's common part, the config of a user's own, and how
its keyword arguments are bound to it (`bind`).

Contract: a reward function is a verifiers rubric function, sync or async, that names the rubric
arguments it wants (`prompt`, `completion`, `answer`, `state`, `info`, `task`, a dataset column, or
their plurals for one call per group) and returns a float (a list of floats for a group). Its
config's `kwargs` (a built-in: its own fields) are bound to it before it joins the rubric.

Invariant: a bound function shows verifiers the signature of the original minus the bound names, so
verifiers' argument selection (by signature) and group detection still see the function as written,
and a bound value always wins over a rubric object of the same name.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from prime_rl.config import BaseConfig


class RewardBase(BaseConfig):
    """What every reward function's config shares (read by the caller, not passed to the function)."""

    weight: float = 1.0
    """Weight of this function's score in the rollout's reward (0: a metric only)."""

    name: str | None = None
    """Its name in the rubric and in metrics (`metric/<name>/<env>`); defaults to the function's own
    name. Needed when two functions of an env's rubric would have the same name."""


class CustomReward(RewardBase):
    """Your own function: a verifiers rubric function taking the arguments it names (`prompt`,
    `completion`, `answer`, `state`, ...) plus `kwargs`, returning a float."""

    type: str
    """Where the function lives, as 'package.module:function'."""

    kwargs: dict[str, Any] = {}
    """Keyword arguments passed to the function on every call."""


def unknown_kwargs(fn: Callable[..., Any], kwargs: dict[str, Any]) -> list[str]:
    """The keys of `kwargs` that `fn` cannot take (none if it takes **kwargs or has no signature)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    takes = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return [k for k in kwargs if k not in takes]


def bind(fn: Callable[..., Any], kwargs: dict[str, Any], name: str) -> Callable[..., Any]:
    """`fn` with `kwargs` bound, named `name`, as a function verifiers can call by signature."""
    sig = inspect.signature(fn)
    # verifiers passes only the parameters it sees (or all of its objects to a **kwargs function):
    # hiding the bound ones keeps it from filling them with a rubric object of the same name.
    shown = [p for n, p in sig.parameters.items() if n not in kwargs]
    if inspect.iscoroutinefunction(fn):

        async def bound(**rubric_args):
            return await fn(**{**rubric_args, **kwargs})
    else:

        def bound(**rubric_args):
            return fn(**{**rubric_args, **kwargs})

    functools.update_wrapper(bound, fn)
    del bound.__wrapped__  # inspect must read the signature below, not the original's
    bound.__name__ = bound.__qualname__ = name
    bound.__signature__ = sig.replace(parameters=shown)
    return bound
