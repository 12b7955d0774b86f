"""One request with `n = group size` for a group's identical first turns, under verifiers.

verifiers sends one chat request per rollout (`n = 1`). The rollouts of a group share their prompt,
so their first requests are byte-identical: this HTTP transport, installed under the OpenAI client
of every server, holds them until every rollout of the group has sent its first request (or
finished without one), sends each distinct body once with `n` set to the number of rollouts that
sent it, and gives each rollout one of the choices as a response of its own (one choice, index 0,
its own usage). The server then renders, tokenizes and schedules the prompt once per group, and
answers once. Later turns, requests outside a group and non-chat routes pass through unchanged.

Invariants: every held request gets exactly one response or exception, and a response carries one
choice that no other rollout of the group got; a server error or a transport exception reaches
every rollout of the batch as if each had sent the request alone. Holding is only an optimization:
a group whose rollouts do not all send within `HOLD_S` is sent with what has arrived.

The group is known through a context variable that the group runner sets (`grouped`); a rollout is
known by its own asyncio task context (`rollout_slot`), set for each `run_rollout` call. Under
`run_group`, where verifiers makes the rollout tasks, the group's first `size` requests are taken
as its first turns: no rollout can send a second turn before the batch it is in was answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import httpx2
import msgspec

log = logging.getLogger(__name__)

HOLD_S = 1.0
"""Longest a held first request waits for the rest of its group (only reached when a rollout spends
that long before its first request, e.g. a slow env setup)."""

CHAT_PATH = "/chat/completions"

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode


@dataclass(eq=False)
class _Held:
    request: httpx2.Request | None
    """The HTTP request (transport level), or None (`merged_post`, body level)."""
    body: bytes
    future: asyncio.Future


@dataclass(eq=False)
class GroupRequests:
    """The first requests of one group's rollouts, held until all of them are in."""

    open: int
    """Rollouts that may still send a first request."""
    held: list[_Held] = field(default_factory=list)
    _timer: asyncio.TimerHandle | None = None
    requests_sent: int = 0
    """Requests this group's first turns cost (for metrics and tests)."""

    def join(self, request: httpx2.Request | None, body: bytes) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.held.append(_Held(request, body, fut))
        if len(self.held) >= self.open:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(HOLD_S, self._give_up)
        return fut

    def withdraw(self) -> None:
        """A rollout finished without a first request: do not wait for it."""
        self.open -= 1
        if self.held and len(self.held) >= self.open:
            self._flush()

    def _give_up(self) -> None:
        self._timer = None
        self.open = len(self.held)  # the stragglers send on their own
        self._flush()

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self.held = self.held, []
        self.open -= len(batch)
        by_body: dict[bytes, list[_Held]] = {}
        for h in batch:
            if h.future.done():  # its rollout was cancelled while it waited
                continue
            by_body.setdefault(h.body, []).append(h)
        for members in by_body.values():
            self.requests_sent += 1
            # The first member sends for all (in its own task, so that cancelling the group cancels it).
            members[0].future.set_result(members)


@dataclass(eq=False)
class RolloutSlot:
    group: GroupRequests
    sent: bool = False


_GROUP: ContextVar[GroupRequests | None] = ContextVar("prime_rl_group_requests", default=None)
_SLOT: ContextVar[RolloutSlot | None] = ContextVar("prime_rl_rollout_slot", default=None)


@contextlib.contextmanager
def grouped(size: int) -> Iterator[GroupRequests]:
    """Within this block (and the tasks it starts), the first `size` chat requests form one group."""
    group = GroupRequests(size)
    token = _GROUP.set(group)
    try:
        yield group
    finally:
        _GROUP.reset(token)


@contextlib.contextmanager
def rollout_slot() -> Iterator[None]:
    """Within this block, run one rollout of the current group: its first request is held."""
    group = _GROUP.get()
    if group is None:
        yield
        return
    slot = RolloutSlot(group)
    token = _SLOT.set(slot)
    try:
        yield
    finally:
        _SLOT.reset(token)
        if not slot.sent:
            group.withdraw()


Send = Callable[[bytes], Awaitable[tuple[int, bytes]]]
"""POST a chat request body; the answer's status and body (raises on a transport failure)."""


def _first_turn(group: GroupRequests | None) -> bool:
    """Whether the current rollout's chat request is one of its group's first turns (and mark it)."""
    if group is None:
        return False
    slot = _SLOT.get()
    if slot is not None:
        if slot.sent:
            return False
        slot.sent = True
        return True
    return group.open > 0


async def merged_post(body: bytes, send: Send) -> tuple[int, bytes]:
    """`send(body)`, or, for a group's first turns, one `send` with `n` for all of them (the module's
    invariants hold; this is the same merging on request bodies instead of HTTP requests)."""
    group = _GROUP.get()
    if not _first_turn(group):
        return await send(body)
    result = await group.join(None, body)
    if not isinstance(result, list):
        return result
    members, others = result, result[1:]
    try:
        answers = await _send_bodies(members, send)
    except BaseException as e:
        for h in others:
            if not h.future.done():
                h.future.set_exception(
                    RuntimeError("the group's merged request was cancelled")
                    if isinstance(e, asyncio.CancelledError)
                    else e
                )
        raise
    for h, answer in zip(others, answers[1:], strict=True):
        if not h.future.done():
            h.future.set_result(answer)
    return answers[0]


async def _send_bodies(members: list[_Held], send: Send) -> list[tuple[int, bytes]]:
    n = len(members)
    body = _with_n(members[0].body, n) if n > 1 else None
    if body is not None:
        status, content = await send(body)
        if status != 200:  # an error is every member's answer, as if each had sent it
            return [(status, content)] * n
        parts = _split(content, n)
        if parts is not None:
            return [(status, part) for part in parts]
        log.warning("the server answered n=%d with another number of choices: sending one by one", n)
    return list(await asyncio.gather(*(send(h.body) for h in members)))


def _split(content: bytes, n: int) -> list[bytes] | None:
    """One single-choice response body per choice of a `n`-choice one; None if it is not that."""
    try:
        data = _json_decode(content)
        choices = data["choices"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return None
    if not isinstance(choices, list) or len(choices) != n:
        return None
    usage = data.get("usage") or {}
    prompt_tokens = usage.get("prompt_tokens", 0)
    bodies = []
    for i, choice in enumerate(choices):
        completion_tokens = len(choice.get("token_ids") or []) if "token_ids" in choice else None
        if completion_tokens is None:
            logprobs = (choice.get("logprobs") or {}).get("content")
            completion_tokens = len(logprobs) if logprobs is not None else 0
        one = {
            **data,
            "id": f"{data.get('id', 'chatcmpl')}-{i}",
            "choices": [{**choice, "index": 0}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
        bodies.append(_json_encode(one))
    return bodies


def _with_n(body: bytes, n: int) -> bytes | None:
    try:
        data = _json_decode(body)
    except msgspec.DecodeError:
        return None
    if not isinstance(data, dict) or data.get("n", 1) != 1 or data.get("stream"):
        return None
    data["n"] = n
    return _json_encode(data)


class CoalescingTransport(httpx2.AsyncBaseTransport):
    """Wraps a transport; holds and merges the first chat requests of a group (module docstring)."""

    def __init__(self, inner: httpx2.AsyncBaseTransport):
        self.inner = inner

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        group = _GROUP.get()
        if group is None or request.method != "POST" or not request.url.path.endswith(CHAT_PATH):
            return await self.inner.handle_async_request(request)
        slot = _SLOT.get()
        if slot is not None:
            if slot.sent:
                return await self.inner.handle_async_request(request)
            slot.sent = True
        elif group.open <= 0:
            return await self.inner.handle_async_request(request)
        await request.aread()
        fut = group.join(request, request.content)
        result = await fut
        if isinstance(result, list):  # this rollout sends for `result`
            return await self._send(result)
        return result

    async def _send(self, members: list[_Held]) -> httpx2.Response:
        others = members[1:]
        try:
            responses = await self._send_merged(members)
        except BaseException as e:
            for h in others:
                if not h.future.done():
                    if isinstance(e, asyncio.CancelledError):
                        e = RuntimeError("the group's merged request was cancelled")
                    h.future.set_exception(e)
            raise
        for h, resp in zip(others, responses[1:], strict=True):
            if not h.future.done():  # its rollout may have been cancelled meanwhile
                h.future.set_result(resp)
        return responses[0]

    async def _send_merged(self, members: list[_Held]) -> list[httpx2.Response]:
        n = len(members)
        body = _with_n(members[0].body, n) if n > 1 else None
        if body is None:  # alone, or a body we will not touch: one request each, concurrently
            return list(await asyncio.gather(*(self._alone(h.request) for h in members)))
        first = members[0].request
        headers = [(k, v) for k, v in first.headers.multi_items() if k.lower() != "content-length"]
        merged = httpx2.Request(
            first.method, first.url, headers=headers, content=body, extensions=first.extensions
        )
        resp = await self.inner.handle_async_request(merged)
        content = await resp.aread()
        await resp.aclose()
        if resp.status_code != 200:  # an error is every member's answer, as if each had sent it
            parts = [content] * n
        else:
            parts = _split(content, n)
            if parts is None:  # a server that ignores `n`: never hand one completion to two rollouts
                log.warning(
                    "%s answered n=%d with another number of choices: sending one by one", first.url, n
                )
                return list(await asyncio.gather(*(self._alone(h.request) for h in members)))
        return [_response(resp, part, h.request) for h, part in zip(members, parts, strict=True)]

    async def _alone(self, request: httpx2.Request) -> httpx2.Response:
        resp = await self.inner.handle_async_request(request)
        content = await resp.aread()
        await resp.aclose()
        return _response(resp, content, request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def _response(resp: httpx2.Response, content: bytes, request: httpx2.Request) -> httpx2.Response:
    headers = [
        (k, v)
        for k, v in resp.headers.multi_items()
        if k.lower() not in ("content-length", "content-encoding", "transfer-encoding")
    ]
    return httpx2.Response(
        resp.status_code,
        headers=headers,
        content=content,
        request=request,
        extensions={"http_version": resp.extensions.get("http_version", b"HTTP/1.1")},
    )
