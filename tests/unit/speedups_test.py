"""The speed-ups of verifiers' per-rollout machinery compute what verifiers would: the cached
signatures equal `inspect.signature`, and the direct POST fails the way openai's client does."""

import asyncio
import functools
import inspect

import pytest

from fake_server import FakeServer, Reply
from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.envs import speedups
from prime_rl.orchestrator.envs.client import DirectPost, make_vf_client


def plain(a, b=1, *args, c, **kw): ...


async def coroutine(x: int) -> list: ...


class Rubric:
    def method(self, completion, answer): ...

    @classmethod
    def cls(cls, states): ...

    def __call__(self, prompt): ...


@functools.wraps(plain)
def wrapped(*args, **kwargs): ...


@pytest.mark.parametrize(
    "func",
    [
        plain,
        coroutine,
        Rubric().method,
        Rubric().cls,
        Rubric(),
        wrapped,
        functools.partial(plain, 1),
        len,
        lambda q: q,
    ],
)
def test_cached_signatures_equal_inspects(func):
    assert speedups.signature(func) == inspect.signature(func)
    assert speedups.signature(func) == inspect.signature(func)  # from the cache where cached


def test_methods_of_two_instances_share_the_functions_signature_without_self():
    a, b = Rubric(), Rubric()
    assert speedups.signature(a.method) is speedups.signature(b.method)
    assert list(speedups.signature(a.method).parameters) == ["completion", "answer"]


def post(base_url: str, retries: int, body: dict | None = None):
    client = make_vf_client(base_url, ClientConfig(base_urls=[base_url], max_retries=retries))
    assert isinstance(client.client, DirectPost)
    import httpx

    body = body or {"model": "m", "messages": [{"role": "user", "content": "abc"}]}

    async def go():
        try:
            return await client.client.post("/chat/completions", body=body, cast_to=httpx.Response)
        finally:
            await client.close()

    return asyncio.run(go())


def test_direct_post_answers_and_retries_5xx_like_openai():
    with FakeServer(lambda req, i: Reply(status=503) if i < 2 else Reply()) as server:
        response = post(server.base_url, retries=2)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]["content"] == "cba"
    assert len(server.requests) == 3


def test_direct_post_raises_openais_errors():
    import openai

    with FakeServer(lambda req, i: Reply(status=500)) as server:
        with pytest.raises(openai.InternalServerError):
            post(server.base_url, retries=1)
        assert len(server.requests) == 2
    with FakeServer(lambda req, i: Reply(status=400)) as server:
        with pytest.raises(openai.BadRequestError):  # verifiers reads an overlong prompt from it
            post(server.base_url, retries=3)
        assert len(server.requests) == 1  # a refused request is not repeated
    with FakeServer() as server:
        gone = server.base_url
    with pytest.raises(openai.APIConnectionError):
        post(gone, retries=0)


def test_with_an_exchange_chat_requests_are_its_calls_and_its_errors_openais():
    """vLLM's engine in the process (`engine/local.py`) answers through `exchange`: the body goes
    to it unchanged, its answer comes back as the server's would, a 400 is openai's BadRequestError
    (verifiers reads an overlong prompt from it), and nothing is sent over HTTP."""
    import json

    import httpx
    import openai

    calls = []

    async def exchange(content: bytes) -> tuple[int, bytes]:
        calls.append(json.loads(content))
        if "too long" in calls[-1]["messages"][0]["content"]:
            return 400, b'{"error": {"message": "prompt too long", "code": 400}}'
        return 200, b'{"choices": [{"message": {"content": "cba"}}]}'

    url = "http://nowhere.invalid/v1"  # a request over HTTP would fail to connect
    client = make_vf_client(url, ClientConfig(base_urls=[url], max_retries=3), exchange=exchange)
    assert isinstance(client.client, DirectPost)

    async def chat(content: str):
        body = {"model": "m", "messages": [{"role": "user", "content": content}]}
        return await client.client.post("/chat/completions", body=body, cast_to=httpx.Response)

    async def go():
        try:
            answer = await chat("abc")
            with pytest.raises(openai.BadRequestError):
                await chat("too long")
            return answer
        finally:
            await client.close()

    answer = asyncio.run(go())
    assert answer.json()["choices"][0]["message"]["content"] == "cba"
    assert [c["messages"][0]["content"] for c in calls] == ["abc", "too long"]  # once each: no retry
