"""A verifiers v1 env as the orchestrator runs it: its taskset streamed as examples, and a group as
`size` episodes of one task whose seats the policy plays in this process (`agent.py`).

A v1 env is a package exporting a `Taskset` subclass of `Task`s (scored by `@vf.reward` and
`@vf.metric` methods), and optionally an `Env` subclass for its own control flow (`run`: several
turns, several seats; `finalize`: judgement across the episode's traces). `[[envs]] args` are the
taskset's config. verifiers' own episode machinery (`Env.run_episode`: a harness program per seat
in a runtime, model calls through an interception server) is replaced by `run_episode` here, which
calls the same env hooks with `Seat`s for agents.

Invariant: `run_group` returns exactly `size` rollouts, one per episode, and raises only when
cancelled: an episode that fails, times out, or has other than one trainable trace is a failed
rollout saying why.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

from prime_rl.engine.sampling import SamplingArgs
from prime_rl.environments import EnvError, env_module_name
from prime_rl.environments import load_v1_env as load_env
from prime_rl.orchestrator.envs.agent import Seat, has_toolsets, initial_messages, trace_task
from prime_rl.orchestrator.envs.policy import Policy, SharedFirstTurn, TurnAudit
from prime_rl.orchestrator.envs.renderer import Renderer
from prime_rl.orchestrator.envs.rewards import RewardRunner
from prime_rl.orchestrator.envs.sandboxed_tools import ENV as TOOLS_ENV
from prime_rl.orchestrator.envs.sandboxed_tools import HOST as TOOL_SESSION
from prime_rl.orchestrator.envs.sandboxed_tools import SandboxedTools
from prime_rl.orchestrator.envs.scoring import RewardError, Scorer
from prime_rl.orchestrator.envs.speedups import cache_default_factory_signatures
from prime_rl.orchestrator.envs.verifiers_adapter import from_trace
from prime_rl.orchestrator.envs_config import RewardsConfig
from prime_rl.orchestrator.messages import Example
from prime_rl.orchestrator.rollout import Rollout, failed_rollout
from prime_rl.runtime import activity
from prime_rl.sandbox.bwrap import SandboxUnavailable, check
from prime_rl.sandbox.config import SandboxConfig
from prime_rl.sandbox.tools_host import ToolsHost

log = logging.getLogger("prime_rl.orchestrator")


class TaskStream:
    """A v1 taskset as the loop reads it: each task as an `Example` (its `idx`, its data as JSON),
    read lazily from the taskset on each iteration; the taskset is never listed."""

    def __init__(self, taskset):
        self.taskset = taskset

    def __iter__(self) -> Iterator[Example]:
        for task in self.taskset:
            yield Example(task.data.idx, task.data.model_dump(mode="json", exclude_defaults=True))


def _seat_args(args: SamplingArgs, role) -> SamplingArgs:
    """The group's sampling args with what the role's own `sampling` sets."""
    own = role.sampling.model_dump(exclude_unset=True, exclude_none=True) if role.sampling else {}
    known = {k: own.pop(k) for k in ("temperature", "top_p", "max_tokens") if k in own}
    return SamplingArgs(**{**args.__dict__, **known, "extra": {**args.extra, **own.get("extra_body", {})}})


@dataclass
class Episode:
    """One finished episode, with what token-in did on each of its traces."""

    episode: Any
    audits: dict[str, TurnAudit] = field(default_factory=dict)


async def run_episode(env, task, policy: Policy, shared_tools: list):
    """One episode of `task`: the env's `setup`, `run` and `finalize` with `Seat`s as its agents
    (verifiers' `Env.run_episode`, played in this process)."""
    episode = vf.Episode(
        env=vf.EnvInfo(id=env.config.env_id),
        task=trace_task(task),
    )

    def seat(name: str, role) -> Seat:
        if role.model is not None or role.client is not None:
            raise EnvError(
                f"env '{env.config.env_id}': role '{name}' pins a model or client; every seat is "
                "played by the policy being trained"
            )
        return Seat(name, role, policy, _seat_args(policy.args, role), episode.traces, shared_tools)

    agents = vf.Agents(env.config, seat)
    timeout = env.config.timeout
    try:
        async with asyncio.timeout(timeout.episode):
            await env.setup(agents)
            await env.run(task, agents)
            if not episode.traces:
                raise ValueError(f"{type(env).__name__}.run() ran no agent")
        async with asyncio.timeout(timeout.finalize):
            await env.finalize(task, episode)
    except Exception as e:
        episode.is_timeout = isinstance(e, TimeoutError)
        episode.errors.append(vf.Error(type=type(e).__name__, message=str(e) or "deadline exceeded"))
        return episode
    episode.ok = all(t.ok for t in episode.traces)
    return episode


@functools.cache
def default_runner() -> RewardRunner:
    """The reward runner of an env used without the orchestrator's (default `[rewards]`)."""
    return RewardRunner(RewardsConfig())


@dataclass
class V1Env:
    """A loaded v1 env, with the surface the orchestrator's env side uses."""

    env: Any
    first: Any
    """The taskset's first task: how its tasks score, and what the others are rebuilt as."""
    shared_tools: list = field(default_factory=list)
    scorer: Scorer | None = None
    env_id: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    sandbox: SandboxConfig | None = None
    """Where its tools run: a sandboxed tool host (started at the first tool use); None: in process."""
    host: ToolsHost | None = None
    _host_lock: asyncio.Lock | None = None
    _host_error: EnvError | None = None

    def use(self, scorer: Scorer) -> None:
        """Score with `scorer` (the env's config adds rewards to it)."""
        self.scorer = scorer

    @property
    def requires_group_rollouts(self) -> bool:
        """Whether a group reward scores the group's traces together (then a failure fails all)."""
        return self.scorer is not None and self.scorer.group_scoring(self.first)

    async def close(self) -> None:
        if self.host is not None:  # seats and renderers are per group or per process
            await self.host.close()
            self.host = None

    async def _open_tools(self, box, task):
        if self._host_lock is None:
            self._host_lock = asyncio.Lock()
        async with self._host_lock:
            if self._host_error is not None:  # an import that failed fails again: not retried
                raise self._host_error
            if self.host is not None and self.host.gone:
                log.warning(
                    f"env '{self.env_id}': its tool host died (the machine's memory?): starting another"
                )
                await self.host.close()
                self.host = None
            if self.host is None:
                # Imported once in the host, before its sessions fork: a session then only builds
                # its tools (loading the env imports the orchestrator's env side and verifiers).
                modules = [
                    TOOL_SESSION,
                    __name__,
                    env_module_name(self.env_id),
                    f"{TOOL_SESSION}:preload",
                ]
                env = {TOOLS_ENV: json.dumps([self.env_id, self.args])}
                try:
                    with activity.waiting(f"the start of env '{self.env_id}''s tool host", "sandbox"):
                        self.host = await ToolsHost.start(modules, self.sandbox, env=env)
                except RuntimeError as e:
                    self._host_error = EnvError(f"env '{self.env_id}': {e}")
                    raise self._host_error from None
        return await SandboxedTools.open(box, task, self.host, self.env_id, self.sandbox.timeout_s)

    def examples(self, n: int | None = None) -> TaskStream:
        """The taskset's tasks (its first `n`) as the loop streams them."""
        return TaskStream(self.env.taskset if n is None else self.env.taskset.take(n))

    def tasks(self, n: int | None = None) -> Iterator:
        """The taskset's tasks (its first `n`) themselves."""
        return iter(self.env.taskset if n is None else self.env.taskset.take(n))

    def task(self, data: dict[str, Any]):
        """The task whose data is `data` (an `Example.task`)."""
        task = copy.copy(self.first)
        task.data = type(self.first.data).model_validate(data)
        return task

    async def run_group(
        self,
        task,
        example_id: int | str,
        size: int,
        sampler,
        renderer: Renderer,
        model: str,
        args: SamplingArgs,
        env_name: str,
        policy_version: int,
        state_columns: list[str],
        timeout_s: float,
        merge_first_turns: bool = True,
    ) -> list[Rollout]:
        """`size` episodes of `task`, each a rollout; an episode past `timeout_s` fails."""
        policy = Policy(
            sampler=sampler,
            renderer=renderer,
            args=args,
            model=model,
            first_turn=SharedFirstTurn(size) if merge_first_turns and size > 1 else None,
            scorer=self.scorer or Scorer(default_runner()),
            open_tools=self._open_tools if self.sandbox is not None else None,
        )

        def episode():
            return asyncio.ensure_future(
                asyncio.wait_for(run_episode(self.env, task, policy, self.shared_tools), timeout_s)
            )

        # The group's request first: the episodes' set-up would delay it (and, with many groups
        # starting at once, every other group's request too). Where the first prompt is known from
        # the task alone, it is requested before any episode starts; else once the first episode
        # asked for it.
        first, lead = policy.first_turn, None
        try:
            prompt_ids = self._first_prompt(task, policy) if first is not None else None
            if prompt_ids is not None:
                first.prefetch(sampler, prompt_ids, args)
                await asyncio.wait([first.answer, first.sent], return_when=asyncio.FIRST_COMPLETED)
            lead = episode()
            if first is not None and prompt_ids is None:
                await asyncio.wait([lead, first.sent], return_when=asyncio.FIRST_COMPLETED)
            episodes = await asyncio.gather(
                lead, *(episode() for _ in range(size - 1)), return_exceptions=True
            )
        except asyncio.CancelledError:
            if lead is not None:
                lead.cancel()
            raise
        finally:
            if policy.first_turn is not None:
                policy.first_turn.close()
        for episode in episodes:
            if isinstance(episode, asyncio.CancelledError):
                raise episode
        out = [
            self._rollout(e, policy, env_name, example_id, policy_version, state_columns) for e in episodes
        ]
        if not self.requires_group_rollouts:
            return out
        if any(r.failed for r in out):  # a group reward needs every trace of the group
            reason = next(r.error for r in out if r.failed)
            return [
                failed_rollout(env_name, example_id, policy_version, f"group scoring: {reason}") for _ in out
            ]
        traces = [next(t for t in e.traces if t.agent.trainable) for e in episodes]
        try:
            await policy.scorer.score_group(task, traces)
        except RewardError as e:
            return [failed_rollout(env_name, example_id, policy_version, f"reward error: {e}") for _ in out]
        return [
            self._rollout(e, policy, env_name, example_id, policy_version, state_columns) for e in episodes
        ]

    def _first_prompt(self, task, policy: Policy) -> list[int] | None:
        """The first prompt of a single-seat episode of `task` (its system prompt and prompt, no
        tools), or None where the episode's first turn is not known from the task alone. A guess:
        a first turn that differs replaces it (`SharedFirstTurn.sample`)."""
        if task.data.prompt is None or self.shared_tools or has_toolsets(task):
            return None
        wire = [message_to_wire(m) for m in initial_messages(task)]
        return policy.render(wire, None, first=True)

    @staticmethod
    def _rollout(episode, policy: Policy, env_name, example_id, policy_version, state_columns) -> Rollout:
        def failed(reason: str) -> Rollout:
            return failed_rollout(env_name, example_id, policy_version, reason)

        if isinstance(episode, BaseException):
            return failed(f"{type(episode).__name__}: {episode}")
        if episode.errors:  # an env hook failed: none of the episode's traces is trustworthy
            return failed("env error: " + "; ".join(f"{e.type}: {e.message}" for e in episode.errors))
        trainable = [t for t in episode.traces if t.agent.trainable]
        if len(trainable) != 1:
            return failed(
                f"EnvError: the episode has {len(trainable)} trainable traces; prime_rl trains one per "
                "episode (set `agents.<role>.trainable = False` in the env's setup for the others)"
            )
        trace = trainable[0]
        audit = policy.audits.get(trace.id, TurnAudit())
        return from_trace(trace, env_name, example_id, policy_version, state_columns, audit)


def load_v1_env(env_id: str, args: dict[str, Any], sandbox: SandboxConfig | None = None) -> V1Env:
    """The v1 env `env_id` (its taskset, and its own `Env` class if it exports one) with `args` as
    its taskset config; its tools run in a `sandbox` (None: in this process)."""
    cache_default_factory_signatures()  # before the first trace is built
    env = load_env(env_id, args)
    try:
        first = next(iter(env.taskset), None)
    except Exception as e:
        raise EnvError(f"env '{env_id}': its first task cannot be loaded: {type(e).__name__}: {e}") from None
    if first is None:
        raise EnvError(f"env '{env_id}': its taskset has no tasks (with args {args})")
    shared = type(env.taskset).toolsets(env.taskset.config)
    if sandbox is not None and sandbox.runtime == "none":
        if shared or has_toolsets(first):
            log.warning(
                f"env '{env_id}': its tools run UNSANDBOXED, with the run's rights (sandbox.runtime = 'none')"
            )
        sandbox = None
    elif sandbox is not None and (shared or has_toolsets(first)):
        try:
            check()
        except SandboxUnavailable as e:
            raise EnvError(
                f"env '{env_id}': its tools cannot run sandboxed: {e}; or set the env's "
                '`sandbox.runtime = "none"` to run them in the run\'s own process'
            ) from None
    return V1Env(env, first, shared, env_id=env_id, args=dict(args), sandbox=sandbox)
