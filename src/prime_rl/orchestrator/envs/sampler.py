"""One model call, token ids in, token ids out: vLLM's engine in this process, or a server's
`/v1/completions` route with the prompt as token ids.

Nothing here renders a chat template or parses a reply: the agent (`agent.py`) owns the
conversation and its tokens, so the engine's chat layer is skipped on every turn, and the tokens
trained on are the tokens sampled by construction.

Invariants: `sample` returns exactly `n` completions, each with one logprob per token id; a
failure raises an exception whose name the failure bounds know (`loop/failures.py`: a server that
cannot be reached is `ConnectError`, a 5xx `InternalServerError`, a refused request
`BadRequestError`, an engine that died `ServerLostError`).
"""

from __future__ import annotations

import asyncio
import itertools
import random
from typing import Any, Protocol

import msgspec

from prime_rl.auth import clients
from prime_rl.engine.sampling import BadRequestError, Completion, SamplingArgs

KEEPALIVE_EXPIRY_S = 2.0
"""Idle seconds after which a pooled connection is closed instead of reused. A server closes idle
connections on its own timer (uvicorn's and vLLM's default: 5 s); reusing one at the moment it
closes fails the request, so the client gives up first, with a margin for a busy event loop."""


STEP_HEADER = "x-prime-rl-step"
"""The header in which our inference server says the step it served (`inference/vllm_server.py`)."""


class ConnectError(ConnectionError):
    """The server could not be reached (refused, reset, dropped)."""


class InternalServerError(RuntimeError):
    """The server answered with a 5xx status."""


class ServerLostError(RuntimeError):
    """vLLM's engine in this process died during the call."""


class Sampler(Protocol):
    async def sample(self, prompt_ids: list[int], args: SamplingArgs, n: int = 1) -> list[Completion]: ...

    async def close(self) -> None: ...


class EngineSampler:
    """vLLM's engine in this process (`engine/local.LocalEngine`)."""

    streams = True
    """`sample` takes `on_each(index, completion)`, called as each of the `n` finishes, and
    `on_submitted()`, called once the engine has the request."""

    def __init__(self, engine):
        self.engine = engine

    async def sample(
        self, prompt_ids: list[int], args: SamplingArgs, n: int = 1, on_each=None, on_submitted=None
    ) -> list[Completion]:
        from prime_rl.engine.local import EngineStopped

        try:
            return await self.engine.generate(prompt_ids, args, n, on_each, on_submitted)
        except EngineStopped as e:  # as the failure bounds name a member that died under a group
            raise ServerLostError(str(e)) from None

    async def close(self) -> None:
        pass


_ids = itertools.count()
_JSON = msgspec.json.Encoder()


__all__ = ["BadRequestError", "Completion", "ConnectError", "EngineSampler", "SamplingArgs", "ServerSampler"]


class ServerSampler:
    """A vLLM server's `/v1/completions`, prompt as token ids, over one aiohttp session (its C
    parser and pool cost a fraction of openai's client per call: see docs/benchmarks-history.md).
    Connection errors, timeouts, 408/409/429 and 5xx are retried `retries` times with backoff."""

    RETRY_STATUS = frozenset({408, 409, 429})

    def __init__(self, base_url: str, model: str, timeout_s: float, retries: int):
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self.headers = {"Content-Type": "application/json"}
        self.identity, self.key = clients.caller()
        """Each request is signed with it, after the server proved it holds it (`auth/`)."""
        self.timeout_s = timeout_s
        self.retries = retries
        self._session = None  # made on the event loop that uses it

    def body(self, prompt_ids: list[int], args: SamplingArgs, n: int) -> dict[str, Any]:
        body = {
            "model": self.model,
            "prompt": prompt_ids,
            "n": n,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "logprobs": 0,  # the sampled token's logprob alone
            **args.extra,
            "return_token_ids": True,
        }
        if args.max_tokens is not None:
            body["max_tokens"] = args.max_tokens
        if args.cache_salt is not None:
            body["cache_salt"] = args.cache_salt
        return body

    async def sample(self, prompt_ids: list[int], args: SamplingArgs, n: int = 1) -> list[Completion]:
        body, step = await self._post(_JSON.encode(self.body(prompt_ids, args, n)))
        answer = msgspec.json.decode(body)
        choices = sorted(answer.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != n:
            raise InternalServerError(f"{self.url} answered {len(choices)} completions for n={n}")
        return [self._completion(c, step) for c in choices]

    @staticmethod
    def _completion(choice: dict, version: int | None) -> Completion:
        from prime_rl.orchestrator.envs.routes import decode_routes

        ids = choice.get("token_ids")
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
        if ids is None or logprobs is None:
            raise BadRequestError("the server returned no token ids or logprobs (is it vLLM?)")
        routes = decode_routes(choice.get("routed_experts"))
        return Completion(
            token_ids=list(ids),
            logprobs=[float(x) for x in logprobs],
            text=choice.get("text") or "",
            finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
            version=version,
            routes=routes[0] if routes else None,
        )

    def _open(self):
        import aiohttp

        if self._session is None:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_EXPIRY_S)
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=self.headers)
        return self._session

    async def _post(self, content: bytes) -> tuple[bytes, int | None]:
        """The answer, and the step the server served when it answered (our servers say it in
        `STEP_HEADER`; None from others)."""
        import aiohttp

        session = self._open()
        error: Exception = ConnectError(f"{self.url}: not tried")
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 8.0) * (0.75 + 0.5 * random.random()))
            try:
                headers = None
                if self.key is not None:
                    await clients.prove_server(session, self.url, self.key, self.identity)
                    headers = clients.sign_headers(self.key, "POST", self.url, content, self.identity)
                async with session.post(self.url, data=content, headers=headers) as response:
                    status, answer = response.status, await response.read()
                    step = response.headers.get(STEP_HEADER)
            except TimeoutError:
                error = TimeoutError(f"{self.url}: no answer within {self.timeout_s:g}s")
                continue
            except (aiohttp.ClientError, clients.ServerNotOurs) as e:
                error = ConnectError(f"{self.url}: {type(e).__name__}: {e}")
                continue
            if status < 400:
                return answer, int(step) if step and step.lstrip("-").isdigit() else None
            message = _error_message(answer)
            if status >= 500 or status in self.RETRY_STATUS:
                error = InternalServerError(f"{self.url}: HTTP {status}: {message}")
                continue
            raise BadRequestError(f"{self.url}: HTTP {status}: {message}")
        raise error

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _error_message(answer: bytes) -> str:
    try:
        decoded = msgspec.json.decode(answer)
        error = decoded.get("error", decoded) if isinstance(decoded, dict) else decoded
        return str(error.get("message", error) if isinstance(error, dict) else error)[:300]
    except (msgspec.DecodeError, AttributeError):
        return answer[:300].decode(errors="replace")
