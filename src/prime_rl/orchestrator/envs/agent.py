"""The seats of a verifiers v1 env, played in this process: each trace's conversation (the model's
turns, its tool calls, the seat's limits and the task's stops), with the tokens the model saw kept
from turn to turn, recorded on verifiers' own trace graph.

verifiers plays a seat with a harness program in a runtime, whose model calls cross a local
interception server to reach the model. The orchestrator is the policy's client itself, so a
`Seat` plays the conversation directly: a turn is a render (or a bridge, `renderer.py`), one call
to the sampler (token ids in and out, `sampler.py`), and a commit to the trace graph. The env's
own code (`Env.run`, `Env.finalize`, the task's setup, rewards and metrics) runs unchanged: a
`Seat` is what `agents.<role>` is to it (`run(task)`, `interaction(task)`, `trainable`).

Invariants:
- a turn's prompt is the previous turn's prompt + completion + the new messages' tokens
  (`Renderer.bridge`) whenever the template allows; `TurnAudit` counts the turns whose re-rendered
  history would have differed (`drifted`) and those the template forced to re-render (`rendered`);
- `run` and `interaction` never raise for what goes wrong in the conversation (a failed model
  call, a tool, a hook): it is recorded on the trace (`trace.errors`, `ok = False`), and the trace
  ends completed and scored where it can be (rewards that need no runtime).
"""

from __future__ import annotations

import contextlib
import itertools
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

import verifiers.v1 as vf
from verifiers.v1 import graph
from verifiers.v1.dialects import parse_message
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.errors import TaskError, ToolsetError, boundary
from verifiers.v1.session import RolloutLimits, call_hook, hook_boundary
from verifiers.v1.state import state_cls
from verifiers.v1.utils.decorators import invoke

from prime_rl.engine.sampling import SamplingArgs
from prime_rl.orchestrator.envs.policy import Policy, TurnAudit
from prime_rl.orchestrator.envs.tools import ToolBox, parse_calls

_call_ids = itertools.count()


def _overrides(task, hook: str) -> bool:
    """Whether the task's class has its own `hook` (the base one does nothing; verifiers' `invoke`
    inspects the signature on every call)."""
    return getattr(type(task), hook) is not getattr(vf.Task, hook)


def initial_messages(task) -> list:
    """System prompt and prompt of a task, as the chat harness sends them."""
    data = task.data
    messages: list = [vf.SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append(vf.UserMessage(content=data.prompt))
    elif data.prompt:
        messages += list(data.prompt)
    return messages


_identity: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_stops: dict[tuple, list] = {}


def trace_task(task) -> vf.TraceTask:
    """The task as a trace records it. Its key and hash (a JSON dump hashed) are computed once per
    task object: a group's episodes share one."""
    ids = _identity.get(task)
    if ids is None:
        ids = _identity[task] = (task.key, task.hash)
    return vf.TraceTask(type=type(task).__name__, data=task.data, key=ids[0], hash=ids[1])


_toolsets: dict[tuple, bool] = {}


def has_toolsets(task) -> bool:
    """Whether the task's class gives its tasks toolsets (asked once per task class and config)."""
    key = (type(task), id(task.config))
    found = _toolsets.get(key)
    if found is None:
        found = _toolsets[key] = bool(task.toolsets(task.config))
    return found


def stop_hooks(task) -> list[tuple[Any, Any]]:
    """(boundary kind, hook) of the task's `@vf.stop` hooks, found once per task class and config:
    verifiers scans the class for decorated methods on every `hooks` call (0.26 ms)."""
    key = (type(task), id(task.config))
    found = _stops.get(key)
    if found is None:
        found = _stops[key] = [
            (
                hook_boundary(fn, allow_trace=True),
                fn.__name__,
                None if getattr(fn, "__self__", None) is task else fn,
            )
            for fn in task.hooks("stop")
        ]
    return [(kind, getattr(task, name) if fn is None else fn) for kind, name, fn in found]


class Play:
    """One trace's conversation: `open`, then segments (`segment`), then `close`."""

    def __init__(self, seat: Seat, task, has_user: bool):

        self.seat, self.task, self.has_user = seat, task, has_user
        self.trace = vf.Trace(
            task=trace_task(task),
            state=state_cls(type(task))(),
            agent=vf.AgentInfo(config=seat.config, name=seat.name, trainable=seat.trainable),
        )
        stops = stop_hooks(task)
        self.trace_stops = [fn for kind, fn in stops if kind is vf.Trace]
        self.response_stops = [fn for kind, fn in stops if kind is vf.Response]
        c = seat.config
        self.limits = RolloutLimits(c.max_turns, c.max_input_tokens, c.max_output_tokens, c.max_total_tokens)
        self.messages: list = []
        self.tools = ToolBox()
        self.audit = seat.policy.audits.setdefault(self.trace.id, TurnAudit())
        self.failed = False
        self.failure: Exception | None = None
        self.closed = False

    @property
    def ok(self) -> bool:
        return not self.failed and self.trace.stop_condition is None

    def fail(self, error: Exception) -> None:
        self.failed, self.failure = True, error
        self.trace.record_error(error)

    async def open(self) -> bool:

        self.trace.timing.setup.start = time.time()
        try:
            if self.task.data.prompt is None and not self.has_user:
                raise TaskError("task has no prompt and no user to open the conversation")
            async with boundary(TaskError, "task setup"):
                if _overrides(self.task, "setup"):
                    await invoke(self.task.setup, {"trace": self.trace, "runtime": None})
            async with boundary(ToolsetError, "building tool servers"):
                tools = ToolBox.of([*self.task.toolsets(self.task.config), *self.seat.shared_tools])
                if tools.tools and self.seat.policy.open_tools is not None:
                    tools = await self.seat.policy.open_tools(tools, self.task)
                self.tools = tools
        except Exception as e:
            self.fail(e)
            return False
        self.messages = initial_messages(self.task)
        self.trace.timing.setup.end = self.trace.timing.agent.start = time.time()
        return True

    async def _refused(self) -> str | None:
        """The seat's limits and the task's trace stops, before a model call."""

        if (limit := self.limits.reached(self.trace)) is not None:
            return limit
        for stop in self.trace_stops:
            result = await call_hook(stop, {vf.Trace: self.trace})
            if not isinstance(result, bool):
                raise TaskError(f"@stop {stop.__name__} must return bool, got {type(result).__name__}")
            if result:
                return stop.__name__
        return None

    async def segment(self, user: list | None = None) -> None:
        """Model turns until a reply without tool calls (its calls run in between), or until a
        limit, a stop or a failure ends the trace."""
        if user:
            self.messages += user
        try:
            while self.ok:
                if (stopped := await self._refused()) is not None:
                    self.trace.stop(stopped)
                    return
                reply = await self._turn()
                if not self.ok or not reply.tool_calls:
                    return
                for call in reply.tool_calls:
                    result, _ = await self.tools.call(call.name, call.arguments)
                    self.messages.append(vf.ToolMessage(tool_call_id=call.id, content=result, name=call.name))
        except Exception as e:
            self.fail(e)

    async def _turn(self):
        """One model call on the conversation so far, committed to the trace graph."""
        policy, renderer = self.seat.policy, self.seat.policy.renderer
        tools = self.tools.wire()
        turn = graph.prepare_turn(self.trace, self.messages, self.tools.tools)
        previous = turn.previous_renderer_token_ids()
        prompt_ids = None
        if previous is not None:
            prompt_ids = renderer.bridge(*previous, [message_to_wire(m) for m in turn.tail], tools)
        wire = [message_to_wire(m) for m in self.messages]
        if prompt_ids is None:
            prompt_ids = policy.render(wire, tools, first=previous is None)
            self.audit.rendered += 1
        elif renderer.render(wire, tools) != prompt_ids:
            self.audit.drifted += 1
        self.audit.turns += 1
        args = self.seat.args
        started = time.time()
        try:
            if policy.first_turn is not None and self.trace.num_turns == 0 and previous is None:
                completion = await policy.first_turn.sample(policy.sampler, prompt_ids, args)
            else:
                completion = (await policy.sampler.sample(prompt_ids, args, 1))[0]
        except Exception as e:
            turn.abandon()
            self.trace.calls.append(
                vf.ModelCall(
                    model=policy.model,
                    time=vf.TimeSpan(start=started, end=time.time()),
                    error=vf.Error(type=type(e).__name__, message=str(e)),
                )
            )
            raise
        content, calls = parse_calls(completion.text) if self.tools.tools else (completion.text, [])
        message = vf.AssistantMessage(
            content=content,
            tool_calls=[
                vf.ToolCall(id=f"call_{next(_call_ids)}", name=name, arguments=arguments)
                for name, arguments in calls
            ]
            or None,
        )
        finish = "tool_calls" if calls and completion.finish_reason == "stop" else completion.finish_reason
        usage = vf.Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(completion.token_ids))
        response = vf.Response(
            id=f"prime-rl-{next(_call_ids)}",
            created=int(started),
            model=policy.model,
            message=message,
            finish_reason=finish,
            usage=usage,
            tokens=vf.TurnTokens(
                prompt_ids=prompt_ids,
                completion_ids=completion.token_ids,
                completion_logprobs=completion.logprobs,
                bridged=previous is not None,
            ),
        )
        node = turn.commit(response)
        if completion.routes is not None:
            self.audit.routes[node] = completion.routes
        if completion.version is not None:
            self.audit.versions[node] = completion.version
        self.trace.calls.append(
            vf.ModelCall(
                node=node,
                model=policy.model,
                finish_reason=finish,
                usage=usage,
                time=vf.TimeSpan(start=started, end=time.time()),
            )
        )
        self.messages.append(message)
        for stop in self.response_stops:
            if await call_hook(stop, {vf.Response: response, vf.Trace: self.trace}):
                self.trace.stop(stop.__name__)
                break
        return message

    async def close(self):
        """Finish the trace: the task's finalize and scoring (unless it failed), then the verdict."""

        if self.closed:
            return self.trace
        self.closed = True
        trace = self.trace
        trace.timing.agent.end = time.time()
        if not self.failed:
            try:
                async with boundary(TaskError, "task finalize"):
                    if _overrides(self.task, "finalize"):
                        await invoke(self.task.finalize, {"trace": trace, "runtime": None})
                await self.seat.policy.scorer.score(self.task, trace)
            except Exception as e:
                self.fail(e)
        if hasattr(self.tools, "close"):  # a sandboxed session: its processes go now
            await self.tools.close()
            self.audit.sandbox = dict(self.tools.failures)
        trace.is_completed = True
        trace.ok = not self.failed
        trace.split_agent_time()
        return trace


class Exchange:
    """A seat's conversation held open turn by turn, its user being the env (`Env.run`): what
    verifiers' `Interaction` is to it (`turn`, `trace`)."""

    def __init__(self, play: Play):
        self.play = play
        self.started = False
        self.over = False

    @property
    def trace(self):
        return self.play.trace

    async def turn(self, message=None):
        """One user turn (a string, or messages), answered; a `Segment` of what the seat said,
        `terminated` when the conversation ended instead (a limit, a stop, a failure)."""

        play = self.play
        if self.over or play.closed:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        prompted = not self.started and play.task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError("nothing to run a turn on: this exchange takes its next user message")
        if message is not None and prompted:
            raise ValueError("the task's prompt opens this exchange: take its first reply with a bare turn()")
        user = None
        if isinstance(message, str):
            user = [vf.UserMessage(content=message)]
        elif message is not None:
            user = [parse_message(m) if isinstance(m, dict) else m for m in message]
        self.started = True
        turns, nodes = play.trace.num_turns, len(play.trace.nodes)
        if play.ok:
            await play.segment(user)
        if play.trace.num_turns > turns:
            said, saw_reply = [], False
            for node in play.trace.nodes[nodes:]:
                if node.sampled:
                    said.append(node.message)
                    saw_reply = True
                elif saw_reply and isinstance(node.message, vf.ToolMessage):
                    said.append(node.message)
            return vf.Segment(messages=said, root_reply=play.trace.root_reply)
        self.over = True
        return vf.Segment(messages=[], terminated=True)


class Seat:
    """One role of a v1 env (`agents.<role>`), played by the policy in this process."""

    def __init__(
        self, name: str, config, policy: Policy, args: SamplingArgs, completed: list, shared_tools: list
    ):
        self.name = name
        self.config = config
        self.policy = policy
        self.args = args
        self.completed = completed
        self.shared_tools = shared_tools
        self.trainable = True

    async def run(self, task, **_: Any):
        """The seat's run of `task` on its prompt: one segment."""
        play = Play(self, task, has_user=False)
        if await play.open():
            await play.segment()
            if play.ok:
                play.trace.stop("agent_completed")
        trace = await play.close()
        self.completed.append(trace)
        return trace

    @contextlib.asynccontextmanager
    async def interaction(self, task, **_: Any) -> AsyncIterator[Exchange]:
        play = Play(self, task, has_user=True)
        if not await play.open():
            self.completed.append(await play.close())
            raise play.failure
        try:
            yield Exchange(play)
        except Exception as e:
            play.fail(e)
            raise
        finally:
            if play.ok:
                play.trace.stop("user_closed")
            self.completed.append(await play.close())
