"""The verifiers clients of the inference servers, one per base URL, made when first used.

Invariant: every request of one server shares that server's connection pool (and, with
`client.group_requests`, its request merging); a pooled connection is never reused after the
server may have closed it (`KEEPALIVE_EXPIRY_S`).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx2
import msgspec

from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.envs import speedups
from prime_rl.orchestrator.envs.coalesce import CHAT_PATH, CoalescingTransport, merged_post

KEEPALIVE_EXPIRY_S = 2.0
"""Idle seconds after which a pooled connection is closed instead of reused. A server closes idle
connections on its own timer (uvicorn's and vLLM's default: 5 s; 75 s for servers `inference`
starts); reusing one at the moment it closes fails the request with a connection error, so the
client must always give up first, with a margin for a busy event loop."""


def make_vf_client(base_url: str, config: ClientConfig):
    import verifiers as vf
    from openai import AsyncOpenAI, DefaultAsyncHttpxClient

    # openai's own HTTP client (httpx2), without a connection limit. A plain `httpx.AsyncClient` is
    # accepted too, but it made 128 concurrent rollouts 3x slower: its connection pool is rescanned
    # for every request and response (measured; see docs/benchmarks.md).
    transport: httpx2.AsyncBaseTransport = httpx2.AsyncHTTPTransport(
        limits=httpx2.Limits(
            max_connections=None, max_keepalive_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_S
        )
    )
    direct = speedups.enabled()
    if config.group_requests and not direct:
        transport = CoalescingTransport(transport)
    openai = AsyncOpenAI(
        base_url=base_url,
        api_key="prime-rl",
        max_retries=config.max_retries,
        timeout=config.timeout_s,
        http_client=DefaultAsyncHttpxClient(transport=transport),
    )
    return vf.OpenAIChatCompletionsClient(DirectPost(openai, transport, config) if direct else openai)


class DirectPost:
    """An `AsyncOpenAI` whose `post(path, body=..., cast_to=<httpx Response>)`, the one call verifiers'
    chat client makes per model call, goes straight to the HTTP transport (the same connections)
    and merges a group's first turns itself (`coalesce.merged_post`); everything else is the
    OpenAI client's.

    openai's request machinery and httpx2's request building cost about 1 ms of CPU per request here,
    several times the HTTP exchange itself (measured with `benchmarks/orchestrator.py`). The
    behaviour is openai's: `max_retries` retries of connection errors, timeouts, 408/409/429 and 5xx
    with backoff, and failures raise openai's own exceptions, so that verifiers (an overlong prompt
    is a `BadRequestError`) and the failure bounds (by exception name) see what they saw before.
    """

    RETRY_STATUS = frozenset({408, 409, 429})

    def __init__(self, openai, transport: httpx2.AsyncBaseTransport, config: ClientConfig):
        self._openai = openai
        self._transport = transport
        self._base = str(openai.base_url).rstrip("/")
        self._urls: dict[str, httpx2.URL] = {}
        self._headers = [(b"Content-Type", b"application/json"), (b"Accept", b"application/json"),
                         (b"Authorization", f"Bearer {openai.api_key}".encode())]  # fmt: skip
        t = config.timeout_s
        self._extensions = {"timeout": {"connect": t, "read": t, "write": t, "pool": t}}
        self._retries = config.max_retries
        self._merge = config.group_requests

    def __getattr__(self, name: str):
        return getattr(self._openai, name)

    async def post(self, path: str, *, cast_to=None, body=None, options=None, **kwargs):
        raw = getattr(cast_to, "__name__", "") == "Response" and getattr(
            cast_to, "__module__", ""
        ).startswith("httpx")
        extra = (options or {}).get("headers")
        if kwargs or extra or not raw or not isinstance(body, dict):
            return await self._openai.post(path, cast_to=cast_to, body=body, options=options or {}, **kwargs)
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx2.URL(self._base + path)

        async def send(content: bytes) -> tuple[int, bytes]:
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

    async def _exchange(self, url: httpx2.URL, content: bytes) -> tuple[int, bytes]:
        """POST with openai's retries; the last answer, or openai's exception for a transport failure."""
        import openai

        for attempt in range(self._retries + 1):
            if attempt:
                await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 8.0) * (0.75 + 0.5 * random.random()))
            request = httpx2.Request(
                "POST", url, headers=self._headers, content=content, extensions=self._extensions
            )
            try:
                response = await self._transport.handle_async_request(request)
                try:
                    answer = await response.aread()
                finally:
                    await response.aclose()
            except httpx2.TimeoutException:
                error: Exception = openai.APITimeoutError(request=request)
                continue
            except httpx2.HTTPError:
                error = openai.APIConnectionError(request=request)
                continue
            status = response.status_code
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
    """The verifiers client of each server the loop sends groups to."""

    def __init__(self, config: ClientConfig):
        self.config = config
        self._clients: dict = {}

    def get(self, base_url: str):
        client = self._clients.get(base_url)
        if client is None:
            client = self._clients[base_url] = make_vf_client(base_url, self.config)
        return client

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()
