"""What the seats of one group sample from (`Policy`): the sampler, the chat template, the group's
shared first turn, and what token-in recorded of each trace's turns (`TurnAudit`).

Invariant: a group's identical first turns are one request for `size` completions, each handed to
one seat; a first turn that differs, or comes after `size` were handed out, is a request of its own.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from prime_rl.engine.sampling import Completion, SamplingArgs
from prime_rl.orchestrator.envs.renderer import Renderer


@dataclass
class TurnAudit:
    """What token-in did for one trace's turns."""

    turns: int = 0
    rendered: int = 0
    """Turns rendered from the whole conversation: the first, and those the template could not
    extend (`Renderer.bridge` gave None)."""
    drifted: int = 0
    """Bridged turns whose history, re-rendered from messages, differs from the tokens the model
    saw: the turns that would have split the rollout into several samples."""
    versions: dict[int, int] = field(default_factory=dict)
    """The policy version each call's completion finished at (where the server says), by the
    call's assistant node."""
    routes: dict[int, Any] = field(default_factory=dict)
    """A MoE server's routed experts of each call, by the call's assistant node."""
    sandbox: dict[str, int] = field(default_factory=dict)
    """Its sandboxed tool calls that failed, by how (`sandbox.tools_host.FAILURES`)."""


class SharedFirstTurn:
    """The identical first turns of a group's traces as one request for `size` completions: the
    prompt is prefilled once. A first turn that differs (or comes after `size` were handed out)
    is its own request. Where the sampler streams (`streams`), each seat gets its completion as
    soon as it ends, not with the group's longest."""

    def __init__(self, size: int):
        self.size = size
        self.key: tuple | None = None
        self.answer: asyncio.Future | None = None
        self.each: list[asyncio.Future] = []
        self.handed = 0
        self.guessed = False
        """The request was made before any seat asked (`prefetch`)."""
        self.sent: asyncio.Future = asyncio.get_running_loop().create_future()
        """Done once the group's request is out (in the engine, where the sampler says)."""

    def _request(self, sampler, prompt_ids: list[int], args: SamplingArgs) -> None:
        loop = asyncio.get_running_loop()
        # This request's own futures: a replaced request's callbacks must not touch the next one's.
        each = self.each = [loop.create_future() for _ in range(self.size)]
        for f in each:  # a failure reaches every seat; retrieved here for those never taken
            f.add_done_callback(lambda f: f.cancelled() or f.exception())

        def one(i: int, completion: Completion) -> None:
            if not each[i].done():
                each[i].set_result(completion)

        def all_(answer: asyncio.Future) -> None:
            for i, f in enumerate(each):
                if f.done():
                    continue
                if answer.cancelled():
                    f.cancel()
                elif answer.exception() is not None:
                    f.set_exception(answer.exception())
                else:
                    f.set_result(answer.result()[i])

        def submitted() -> None:
            if not self.sent.done():
                self.sent.set_result(None)

        streams = getattr(sampler, "streams", False)
        call = (
            sampler.sample(prompt_ids, args, self.size, on_each=one, on_submitted=submitted)
            if streams
            else sampler.sample(prompt_ids, args, self.size)
        )
        self.answer = asyncio.ensure_future(call)
        self.answer.add_done_callback(all_)
        if not streams:
            submitted()

    def prefetch(self, sampler, prompt_ids: list[int], args: SamplingArgs) -> None:
        """Request the group's first turn before any seat asks for it: `prompt_ids` is a guess at
        the first seat's prompt, which replaces the request if it differs."""
        self.key, self.guessed = (tuple(prompt_ids), args), True
        self._request(sampler, prompt_ids, args)

    async def sample(self, sampler, prompt_ids: list[int], args: SamplingArgs) -> Completion:
        key = (tuple(prompt_ids), args)
        if self.guessed and self.handed == 0 and key != self.key:  # the guess missed
            self.answer.cancel()
            self.answer = None
        self.guessed = False
        if self.answer is None:
            self.key = key
            self._request(sampler, prompt_ids, args)
        if key != self.key or self.handed >= self.size:
            return (await sampler.sample(prompt_ids, args, 1))[0]
        i, self.handed = self.handed, self.handed + 1
        return await self.each[i]

    def close(self) -> None:
        """The group is over (or cancelled): a request still out is of no use to anyone."""
        if self.answer is not None and not self.answer.done():
            self.answer.cancel()


@dataclass
class Policy:
    """What every seat of one group samples from."""

    sampler: Any
    renderer: Renderer
    args: SamplingArgs
    model: str
    first_turn: SharedFirstTurn | None = None
    scorer: Any = None
    """The env's `scoring.Scorer`."""
    open_tools: Any = None
    """Where tools run sandboxed: an async function taking a trace's `ToolBox` (its schemas) and its
    task, and giving the tools its seat calls (`sandboxed_tools.SandboxedTools`); None: called in process."""
    audits: dict[str, TurnAudit] = field(default_factory=dict)
    """Per trace id."""
    first_prompts: dict[str, list[int]] = field(default_factory=dict)
    """The first turns rendered in this group, by their messages: every episode of a group starts
    from the same task, so its first prompt is rendered once, not once per rollout."""

    def render(self, wire: list[dict], tools: list[dict] | None, first: bool) -> list[int]:
        if not first:
            return self.renderer.render(wire, tools)
        key = json.dumps([wire, tools], sort_keys=True, default=str)
        ids = self.first_prompts.get(key)
        if ids is None:
            ids = self.first_prompts[key] = self.renderer.render(wire, tools)
        return ids
