"""The verifiers clients of the inference servers, one per base URL, made when first used.

Invariant: every request of one server shares that server's connection pool (and, with
`client.group_requests`, its request merging); a pooled connection is never reused after the
server may have closed it (`KEEPALIVE_EXPIRY_S`). An answer the model finished is an answer, even
an empty one (`answered`).
"""

from __future__ import annotations

import asyncio
import functools
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx2
import msgspec

from prime_rl import secret
from prime_rl.engine.local import ENGINE_URL
from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.envs import speedups
from prime_rl.orchestrator.envs.coalesce import CHAT_PATH, CoalescingTransport, merged_post

KEEPALIVE_EXPIRY_S = 2.0
"""Idle seconds after which a pooled connection is closed instead of reused. A server closes idle
connections on its own timer (uvicorn's and vLLM's default: 5 s; 75 s for servers `inference`
starts); reusing one at the moment it closes fails the request with a connection error, so the
client must always give up first, with a margin for a busy event loop."""


def make_vf_client(base_url: str, config: ClientConfig, exchange: Exchange | None = None):
    """verifiers' client of the server at `base_url`; with `exchange`, its chat requests go to that
    function instead (vLLM's engine in this process) and nothing goes over HTTP."""
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    # openai's own HTTP client (httpx2), without a connection limit. A plain `httpx.AsyncClient` is
    # accepted too, but it made 128 concurrent rollouts 3x slower: its connection pool is rescanned
    # for every request and response (measured; see docs/benchmarks.md).
    direct = speedups.enabled() or exchange is not None
    transport: httpx2.AsyncBaseTransport = _pool()
    if config.group_requests and not direct:
        transport = CoalescingTransport(transport)
    openai = AsyncOpenAI(
        base_url=base_url,
        api_key=secret.value() or "prime-rl",  # sent as `Authorization: Bearer`
        max_retries=config.max_retries,
        timeout=config.timeout_s,
        http_client=DefaultAsyncHttpxClient(transport=transport),
    )
    return _client_class()(DirectPost(openai, config, exchange) if direct else openai)


def answered(response) -> bool:
    """Whether `response` is one choice that the model finished (end of sequence, a stop string or
    `max_tokens`): an answer of the policy, whatever its text."""
    choices = getattr(response, "choices", None)
    return bool(choices) and len(choices) == 1 and choices[0].finish_reason in ("stop", "length")


@functools.cache
def _client_class():
    import verifiers as vf

    class PolicyClient(vf.OpenAIChatCompletionsClient):
        """verifiers' chat client, except that an empty answer the model finished is an answer.

        verifiers refuses a response without text or tool calls (`EmptyModelResponseError`) and the
        rollout fails. From a policy that is a sampled answer like any other: failing it dropped it
        from training and sampled another group in its place, so the policy was never taught against
        it (a tiny model early in training answered half its prompts with end-of-sequence alone:
        two groups generated for every one trained). It is scored by the env's rubric instead."""

        async def raise_from_native_response(self, response) -> None:
            if not answered(response):
                await super().raise_from_native_response(response)

    return PolicyClient


def _pool() -> httpx2.AsyncHTTPTransport:
    limits = httpx2.Limits(
        max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_S
    )
    return httpx2.AsyncHTTPTransport(limits=limits)


Exchange = Callable[[bytes], Awaitable[tuple[int, bytes]]]
"""A chat completion body in, the answer's status and body out."""


class DirectPost:
    """An `AsyncOpenAI` whose `post(path, body=..., cast_to=<httpx Response>)`, the one call verifiers'
    chat client makes per model call, is sent by aiohttp and merges a group's first turns itself
    (`coalesce.merged_post`); everything else is the OpenAI client's.

    Why: per model call, openai's request machinery cost ~0.2 ms of CPU and httpx2/httpcore's ~0.4 ms
    more, growing with the connections open (its pool checks every connection on every request);
    aiohttp's C parser and pool cost a fraction of that (measured with `benchmarks/orchestrator.py`).
    The behaviour is openai's: `max_retries` retries of connection errors, timeouts, 408/409/429 and
    5xx with backoff, and failures raise openai's own exceptions, so that verifiers (an overlong
    prompt is a `BadRequestError`) and the failure bounds (by exception name) see what they saw.
    With `exchange` (vLLM's engine in this process), a chat request is that call: no connection, so
    nothing to retry.
    """

    RETRY_STATUS = frozenset({408, 409, 429})

    def __init__(self, openai, config: ClientConfig, exchange: Exchange | None = None):
        self._openai = openai
        self._local = exchange
        self._base = str(openai.base_url).rstrip("/")
        self._headers = {
            "Content-Type": "application/json",
            "Accept": "application/json",
            "Authorization": f"Bearer {openai.api_key}",
        }
        self._timeout_s = config.timeout_s
        self._retries = config.max_retries
        self._merge = config.group_requests
        self._session = None  # made on the event loop that uses it

    def __getattr__(self, name: str):
        return getattr(self._openai, name)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self._openai.close()

    async def post(self, path: str, *, cast_to=None, body=None, options=None, **kwargs):
        raw = getattr(cast_to, "__name__", "") == "Response" and getattr(
            cast_to, "__module__", ""
        ).startswith("httpx")
        extra = (options or {}).get("headers")
        if kwargs or extra or not raw or not isinstance(body, dict):
            return await self._openai.post(path, cast_to=cast_to, body=body, options=options or {}, **kwargs)
        url = self._base + path

        async def send(content: bytes) -> tuple[int, bytes]:
            if self._local is not None and path == CHAT_PATH:
                return await self._local(content)
            return await self._exchange(url, content)

        content = _JSON.encode(body)
        if self._merge and path == CHAT_PATH:
            status, answer = await merged_post(content, send)
        else:
            status, answer = await send(content)
        if status >= 400:
            response = httpx2.Response(status, content=answer, request=httpx2.Request("POST", url))
            raise self._openai._make_status_error_from_response(response)
        return Answer(status, answer)

    def _open(self):
        import aiohttp

        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_EXPIRY_S)
            timeout = aiohttp.ClientTimeout(total=self._timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self._headers)
        return self._session

    async def _exchange(self, url: str, content: bytes) -> tuple[int, bytes]:
        """POST with openai's retries; the last answer, or openai's exception for a transport failure."""
        import aiohttp
        import openai

        session = self._open()
        for attempt in range(self._retries + 1):
            if attempt:
                await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 8.0) * (0.75 + 0.5 * random.random()))
            try:
                async with session.post(url, data=content) as response:
                    status, answer = response.status, await response.read()
            except TimeoutError:
                error: Exception = openai.APITimeoutError(request=httpx2.Request("POST", url))
                continue
            except aiohttp.ClientError as e:
                error = openai.APIConnectionError(
                    message=f"{type(e).__name__}: {e}", request=httpx2.Request("POST", url)
                )
                continue
            if status < 400 or (status < 500 and status not in self.RETRY_STATUS) or attempt == self._retries:
                return status, answer
        raise error


@dataclass(frozen=True, slots=True)
class Answer:
    """A successful answer, as much of an httpx response as verifiers reads (`content`)."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode()

    def json(self):
        return msgspec.json.decode(self.content)


def _pydantic(value):
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", exclude_unset=True, by_alias=True)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


_JSON = msgspec.json.Encoder(enc_hook=_pydantic)


class Clients:
    """The verifiers client of each server the loop sends groups to; with `exchange` (engine mode),
    vLLM's engine in this process (`ENGINE_URL`) is one of them, and that function its transport."""

    def __init__(self, config: ClientConfig, exchange: Exchange | None = None):
        self.config = config
        self.exchange = exchange
        self._clients: dict = {}

    def get(self, base_url: str):
        client = self._clients.get(base_url)
        if client is None:
            exchange = self.exchange if base_url == ENGINE_URL else None  # servers that joined: HTTP
            client = self._clients[base_url] = make_vf_client(base_url, self.config, exchange)
        return client

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
