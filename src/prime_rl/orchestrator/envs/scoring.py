"""Score v1 traces: the task's own `@vf.reward` / `@vf.metric` methods and judges, the rewards the
env's config adds (`[[envs.rewards]]`), and group rewards, each call off the event loop and bounded.

verifiers' `Task.score` awaits every hook on the caller's loop (a plain `def` hook cannot run at
all, and one that computes blocks the loop). Here each hook goes through the `RewardRunner`
(`rewards.py`): a plain function in a worker thread (or inline once shown to be fast), an async
one on the loop, each under `rewards.timeout_s`.

What a hook may ask for, by parameter name:
- a task's methods, as in verifiers: `task` (the task's data) and `trace`;
- an added reward function: also `prompt` and `completion` (the messages, as chat dicts), `answer`
  (the task data's `answer` field), `info` (`trace.info`) and `state` (`trace.state`);
- a group function, called once per group, the plurals: `traces`, `tasks`, `prompts`,
  `completions`, `answers`, `infos`, `states`; it returns one float per trace. A task method that
  takes `traces` is a group reward too.

Invariants: a hook that raises or times out raises `RewardError` naming it (the trace fails, it is
never trained on a made-up score); hooks that need a runtime are skipped (none runs here), once
logged. A group with group functions is scored only when all of its traces succeeded.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

from prime_rl.orchestrator.envs.rewards import RewardRunner

log = logging.getLogger("prime_rl.orchestrator")

GROUP_ARGS = {"traces", "tasks", "prompts", "completions", "answers", "infos", "states"}


class RewardError(RuntimeError):
    """A reward or metric function raised, or ran past its timeout."""


@dataclass(frozen=True)
class Hook:
    """One scoring function: what it records, under which name and weight."""

    fn: Any
    name: str
    kind: str  # "reward" or "metric"
    weight: float = 1.0

    @property
    def params(self) -> frozenset[str]:
        return _params(getattr(self.fn, "__func__", self.fn))

    @property
    def group(self) -> bool:
        return bool(GROUP_ARGS & self.params)


@functools.cache
def _params(fn) -> frozenset[str]:
    """The parameter names of a function (of a method: without `self`), once per function."""
    names = list(inspect.signature(fn).parameters)
    return frozenset(names[1:] if names and names[0] == "self" else names)


def _needs_runtime(fn) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


def _messages(trace) -> tuple[list[dict], list[dict]]:
    from prime_rl.orchestrator.envs.verifiers_adapter import openai_message, to_json

    messages = [openai_message(to_json(m)) for m in trace.messages]
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return messages[:first], messages[first:]


class Arguments(dict):
    """Everything a hook may ask for about one trace (see the module docstring), each computed when
    first asked: most hooks want the trace alone, and the messages cost a walk of its graph."""

    def __init__(self, task, trace):
        super().__init__(task=task.data, trace=trace, info=trace.info, state=trace.state)
        self.trace, self.data = trace, task.data

    def __missing__(self, key: str) -> Any:
        if key in ("prompt", "completion"):
            self["prompt"], self["completion"] = _messages(self.trace)
        elif key == "answer":
            self["answer"] = getattr(self.data, "answer", None)
        else:
            raise KeyError(key)
        return self[key]

    def __contains__(self, key) -> bool:
        return dict.__contains__(self, key) or key in LAZY


LAZY = ("prompt", "completion", "answer")


@dataclass
class Scorer:
    """How one env's traces are scored: the added rewards (`extra`) and the scale of the env's own
    rewards (a reward model's `env_reward_weight`)."""

    runner: RewardRunner
    extra: list[Hook] = field(default_factory=list)
    own_scale: float = 1.0
    _skipped: set[str] = field(default_factory=set)
    _judges: dict[int, list] = field(default_factory=dict)
    _found: dict[tuple, list[Hook]] = field(default_factory=dict)

    def hooks(self, task) -> list[Hook]:
        """The task's hooks bound to it, and the added ones; what to run is found once per task
        class and config (verifiers scans the class for decorated methods on every call)."""
        key = (type(task), id(task.config))
        found = self._found.get(key)
        if found is None:
            found = self._found[key] = self._find(task)
        return [
            Hook(getattr(task, h.name) if h.fn is None else h.fn, h.name, h.kind, h.weight) for h in found
        ]

    def _find(self, task) -> list[Hook]:
        """Like `hooks`, with `fn = None` for the task's own methods (bound per task)."""
        hooks = [Hook(None, fn.__name__, "metric") for fn in task.hooks("metric") if self._runs(fn)] + [
            Hook(None, fn.__name__, "reward", getattr(fn, "_vf_weight", 1.0) * self.own_scale)
            for fn in task.hooks("reward")
            if self._runs(fn)
        ]
        judges = self._judges.get(id(task.config))
        if judges is None:  # loaded once per task config: every task of a taskset shares one
            judges = self._judges[id(task.config)] = task.plugged_judges()
        hooks += [
            Hook(judge.score, judge.reward_name, "reward", judge.config.weight * self.own_scale)
            for judge in judges
            if self._runs(judge.score)
        ]
        return hooks + self.extra

    def _runs(self, fn) -> bool:
        """Whether the hook can run here: not one that needs a runtime (none runs here), logged once."""
        if not _needs_runtime(fn):
            return True
        if fn.__name__ not in self._skipped:
            self._skipped.add(fn.__name__)
            log.info("scoring: '%s' needs a runtime (a sandbox): skipped", fn.__name__)
        return False

    def group_scoring(self, task) -> bool:
        return any(h.group for h in self.hooks(task))

    async def _call(self, hook: Hook, available: dict[str, Any]) -> Any:
        kwargs = {k: available[k] for k in hook.params if k in available}
        fn = hook.fn
        try:
            return await self.runner.call(fn, inspect.iscoroutinefunction(fn), kwargs)
        except TimeoutError:
            raise RewardError(
                f"reward function '{hook.name}' timed out after {self.runner.config.timeout_s:g}s"
            ) from None
        except Exception as e:
            raise RewardError(f"reward function '{hook.name}' raised {type(e).__name__}: {e}") from None

    @staticmethod
    def _record(trace, hook: Hook, value: Any) -> None:
        items = value.items() if isinstance(value, dict) else [(hook.name, value)]
        for name, v in items:
            if hook.kind == "metric":
                trace.record_metric(name, float(v))
            else:
                trace.record_reward(name, float(v), hook.weight)

    async def score(self, task, trace) -> None:
        """The trace's own (per-trace) metrics and rewards; group functions come later."""
        available = Arguments(task, trace)
        for hook in self.hooks(task):
            if not hook.group:
                self._record(trace, hook, await self._call(hook, available))

    async def score_group(self, task, traces: list) -> None:
        """The group functions over the group's traces (all of them succeeded)."""
        hooks = [h for h in self.hooks(task) if h.group]
        if not hooks:
            return
        each = [Arguments(task, t) for t in traces]
        available = {
            "traces": traces,
            "tasks": [a["task"] for a in each],
            "prompts": [a["prompt"] for a in each],
            "completions": [a["completion"] for a in each],
            "answers": [a["answer"] for a in each],
            "infos": [a["info"] for a in each],
            "states": [a["state"] for a in each],
            "task": task.data,
        }
        for hook in hooks:
            values = await self._call(hook, available)
            if not isinstance(values, list | tuple) or len(values) != len(traces):
                raise RewardError(
                    f"group reward function '{hook.name}' returned {values!r} for {len(traces)} traces "
                    "(one float per trace expected)"
                )
            for trace, value in zip(traces, values, strict=True):
                self._record(trace, hook, value)
