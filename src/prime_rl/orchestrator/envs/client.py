"""The verifiers clients of the inference servers, one per base URL, made when first used.

Invariant: every request of one server shares that server's connection pool (and, with
`client.group_requests`, its request merging); a pooled connection is never reused after the
server may have closed it (`KEEPALIVE_EXPIRY_S`).
"""

from __future__ import annotations

import asyncio
import random

import httpx2
import msgspec

from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.envs import speedups
from prime_rl.orchestrator.envs.coalesce import CoalescingTransport

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
    if config.group_requests:
        transport = CoalescingTransport(transport)
    openai = AsyncOpenAI(
        base_url=base_url,
        api_key="prime-rl",
        max_retries=config.max_retries,
        timeout=config.timeout_s,
        http_client=DefaultAsyncHttpxClient(transport=transport),
    )
    return vf.OpenAIChatCompletionsClient(DirectPost(openai, config) if speedups.enabled() else openai)


class DirectPost:
    """An `AsyncOpenAI` whose `post(path, body=..., cast_to=<httpx Response>)`, the one call verifiers'
    chat client makes per model call, goes straight to the OpenAI client's own HTTP client (same
    connections, transport and request merging); everything else is the OpenAI client's.

    openai's request machinery (option models, header and URL building, response wrapping) costs
    about 0.19 ms of CPU per request, 3.5x the HTTP exchange itself (measured on this machine). The
    behaviour is openai's: `max_retries` retries of connection errors, timeouts, 408/409/429 and 5xx
    with backoff, and failures raise openai's own exceptions, so that verifiers (an overlong prompt
    is a `BadRequestError`) and the failure bounds (by exception name) see what they saw before.
    """

    RETRY_STATUS = frozenset({408, 409, 429})

    def __init__(self, openai, config: ClientConfig):
        self._openai = openai
        self._http = openai._client
        self._url = str(openai.base_url).rstrip("/")
        self._headers = {"Content-Type": "application/json", "Accept": "application/json",
                         "Authorization": f"Bearer {openai.api_key}"}  # fmt: skip
        self._retries = config.max_retries
        self._timeout = config.timeout_s

    def __getattr__(self, name: str):
        return getattr(self._openai, name)

    async def post(self, path: str, *, cast_to=None, body=None, options=None, **kwargs):
        raw = getattr(cast_to, "__name__", "") == "Response" and getattr(
            cast_to, "__module__", ""
        ).startswith("httpx")
        if kwargs or not raw or not isinstance(body, dict):
            return await self._openai.post(path, cast_to=cast_to, body=body, options=options or {}, **kwargs)
        import openai

        content = _JSON.encode(body)
        headers = {**self._headers, **((options or {}).get("headers") or {})}
        url = self._url + path
        for attempt in range(self._retries + 1):
            if attempt:
                await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 8.0) * (0.75 + 0.5 * random.random()))
            try:
                response = await self._http.post(url, content=content, headers=headers, timeout=self._timeout)
            except httpx2.TimeoutException as e:
                error: Exception = openai.APITimeoutError(request=e.request)
                continue
            except httpx2.HTTPError as e:
                error = openai.APIConnectionError(request=e.request)
                continue
            if response.status_code < 400:
                return response
            await response.aread()
            error = self._openai._make_status_error_from_response(response)
            if response.status_code < 500 and response.status_code not in self.RETRY_STATUS:
                raise error
        raise error


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
