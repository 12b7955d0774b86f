"""A group's first turns go to the server as one request with n = group size; each rollout gets its
own choice, later turns go one by one, and failures reach every rollout of the merged request."""

import asyncio
import json

import httpx2
import pytest

from fake_server import FakeServer, Reply, user_text
from helpers.groups import run_group_on
from prime_rl.orchestrator.envs import coalesce


def run(env_id: str, server: FakeServer, size: int = 4, group_requests: bool = True):
    """One group through the loop's `run_on` and the in-process env side: (rollouts, its server)."""
    return run_group_on(env_id, server.base_url, size, group_requests)


def test_a_groups_first_turns_are_one_request_and_each_rollout_gets_its_own_choice():
    with FakeServer(distinct_choices=True) as server:
        rollouts, lessee = run("reverse-text", server)
    assert len(server.requests) == 1 and server.requests[0]["n"] == 4
    assert [r.failed for r in rollouts] == [False] * 4
    expected = user_text(server.requests[0])[::-1]
    assert sorted(r.completion[-1]["content"] for r in rollouts) == [expected + "+" * i for i in range(4)]
    for r in rollouts:  # the tokens are those of the rollout's own choice
        assert bytes(r.turns[0].completion_ids).decode() == r.completion[-1]["content"]
        assert r.policy_version == 3
    assert lessee.inflight == 0 and lessee.up


def test_without_group_requests_each_rollout_sends_its_own():
    with FakeServer() as server:
        rollouts, _ = run("reverse-text", server, group_requests=False)
    assert len(server.requests) == 4 and all(r.get("n", 1) == 1 for r in server.requests)
    assert not any(r.failed for r in rollouts)


def test_later_turns_go_one_request_per_rollout():
    with FakeServer(distinct_choices=True) as server:
        rollouts, _ = run("two_turn_env", server)
    assert [r.get("n", 1) for r in server.requests] == [4, 1, 1, 1, 1]
    assert all(len(r.turns) == 2 and r.reward == 2.0 for r in rollouts)
    # Each rollout's second request carries the first answer it got, and no two got the same one.
    firsts = {json.dumps(req["messages"][1]) for req in server.requests[1:]}
    assert len(firsts) == 4


def test_a_group_scored_env_is_merged_too():
    with FakeServer(distinct_choices=True) as server:
        rollouts, _ = run("group_scored_env", server)
    assert len(server.requests) == 1 and server.requests[0]["n"] == 4
    assert not any(r.failed for r in rollouts)
    assert max(r.reward for r in rollouts) == 1.0 and len({r.reward for r in rollouts}) > 1


def test_a_failed_merged_request_fails_every_rollout_of_the_group():
    with FakeServer(lambda req, i: Reply(status=500)) as server:
        rollouts, lessee = run("reverse-text", server)
    assert len(server.requests) == 1
    assert len(rollouts) == 4 and len({id(r) for r in rollouts}) == 4  # distinct objects
    assert all(r.failed and "500" in r.error for r in rollouts)
    assert not lessee.up and lessee.inflight == 0  # the whole group failed: the server is suspect


def test_a_server_that_ignores_n_gets_one_request_per_rollout_instead():
    with FakeServer(ignore_n=True) as server:
        rollouts, _ = run("reverse-text", server)
    assert [r.get("n", 1) for r in server.requests] == [4, 1, 1, 1, 1]
    assert not any(r.failed for r in rollouts)


def _chat(n_choices: int) -> bytes:
    choices = [{"index": i, "message": {"role": "assistant", "content": f"c{i}"}, "token_ids": [i]}
               for i in range(n_choices)]  # fmt: skip
    return json.dumps({"id": "x", "choices": choices, "usage": {"prompt_tokens": 2}}).encode()


def test_a_rollout_that_ends_without_a_request_does_not_hold_the_others(monkeypatch):
    monkeypatch.setattr(coalesce, "HOLD_S", 1000.0)  # only the withdrawal can release the others
    sent = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        body = json.loads(request.content)
        sent.append(body)
        return httpx2.Response(200, content=_chat(body.get("n", 1)))

    transport = coalesce.CoalescingTransport(httpx2.MockTransport(handler))
    request_body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()

    async def rollout(sends: bool):
        with coalesce.rollout_slot():
            if not sends:
                await asyncio.sleep(0)
                return None
            req = httpx2.Request("POST", "http://x/v1/chat/completions", content=request_body)
            resp = await transport.handle_async_request(req)
            return json.loads(await resp.aread())

    async def group():
        with coalesce.grouped(3):
            return await asyncio.wait_for(asyncio.gather(rollout(True), rollout(False), rollout(True)), 30)

    a, none, b = asyncio.run(group())
    assert none is None and [s["n"] for s in sent] == [2]
    assert {a["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"]} == {"c0", "c1"}
    assert a["choices"][0]["index"] == b["choices"][0]["index"] == 0
    assert a["usage"]["completion_tokens"] == 1 and a["id"] != b["id"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models"])
def test_other_routes_pass_through(path):
    seen = []
    transport = coalesce.CoalescingTransport(
        httpx2.MockTransport(lambda r: seen.append(r.url.path) or httpx2.Response(200, content=b"{}"))
    )

    async def go():
        with coalesce.grouped(4), coalesce.rollout_slot():
            return await transport.handle_async_request(
                httpx2.Request("POST", f"http://x{path}", content=b"{}")
            )

    assert asyncio.run(go()).status_code == 200 and seen == [path]
