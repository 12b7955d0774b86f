"""verifiers.v1 envs run through the orchestrator's group runner like classic ones: chosen by what
the env module exports, one rollout per episode with the exact tokens of its model calls, and
failures (a raising reward, a server error) as failed rollouts that say why."""

import asyncio

from fake_server import FakeServer, Reply, encode
from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.envs.client import Clients
from prime_rl.orchestrator.envs.group_runner import GroupRun, run_group
from prime_rl.orchestrator.envs.load import load_env, rollout_input
from prime_rl.orchestrator.envs.v1_env import V1Env
from prime_rl.orchestrator.envs_config import EnvConfig, SamplingConfig
from prime_rl.orchestrator.loop.examples import ExampleSource


def run(
    server: FakeServer,
    args: dict | None = None,
    size: int = 3,
    env_id: str = "v1_test_env",
    timeout_s: float = 10,
    state_columns: tuple[str, ...] = ("word",),
):
    """One group of the env on the fake server, the env torn down after: (env, row, rollouts)."""
    env = load_env(EnvConfig(id=env_id, args=args or {}, group_size=size))
    client = Clients(ClientConfig(base_urls=[server.base_url])).get(server.base_url)
    row = ExampleSource(env.dataset, 0).next()
    job = GroupRun(env.name, env.vf_env, rollout_input(row), row["example_id"], size, 2,
                   SamplingConfig(max_tokens=16), state_columns)  # fmt: skip

    async def go():
        try:
            return await run_group(job, client, server.base_url, "m", timeout_s)
        finally:
            await env.vf_env._teardown()

    return env, row, asyncio.run(go())


def test_a_v1_env_is_chosen_by_its_exports_and_its_rollouts_carry_tokens_reward_and_state():
    with FakeServer() as server:
        env, row, rollouts = run(server)
    assert isinstance(env.vf_env, V1Env) and len(env.dataset) == 6
    assert len(server.requests) == 3 and all(r["logprobs"] and r["return_token_ids"] for r in server.requests)
    assert len(rollouts) == 3 and len({id(r) for r in rollouts}) == 3
    for r in rollouts:
        assert not r.failed, r.error
        assert r.reward == 1.0 and r.metrics == {"reversed_word": 1.0, "reply_length": 5.0}
        assert (
            r.policy_version == 2 and r.example_id == row["example_id"] and r.state == {"word": row["prompt"]}
        )
        (turn,) = r.turns  # the prompt the server saw, then what it sampled, with its logprobs
        assert turn.prompt_ids == encode("".join(m["content"] for m in server.requests[0]["messages"]))
        assert turn.completion_ids == encode(row["prompt"][::-1])
        assert turn.completion_logprobs == [-0.5] * 5 and turn.completion_mask == [1] * 5
        assert r.completion == [{"role": "assistant", "content": row["prompt"][::-1]}]


def test_a_raising_v1_reward_fails_the_rollout_with_the_reason():
    with FakeServer() as server:
        _, _, rollouts = run(server, {"mode": "raise"})
    assert all(r.failed and "judge said no" in r.error for r in rollouts)


def test_a_server_error_fails_each_v1_rollout():
    with FakeServer(lambda req, i: Reply(status=500)) as server:
        _, _, rollouts = run(server)
    assert len(rollouts) == 3 and all(r.failed and "500" in r.error for r in rollouts)


def test_a_v1_episode_past_the_client_timeout_fails():
    with FakeServer(lambda req, i: Reply(delay_s=5)) as server:
        _, _, rollouts = run(server, size=2, timeout_s=0.5)
    assert len(rollouts) == 2 and all(r.failed and "TimeoutError" in r.error for r in rollouts)


def test_a_multi_turn_v1_env_plays_its_turns_and_merges_them_into_one_sample():
    # digit-sum-feedback-v1's own Env drives the turns; the fake server never answers in the format.
    from prime_rl.orchestrator.loop.samples import turn_stats

    with FakeServer() as server:
        _, row, rollouts = run(
            server, {"num_examples": 4}, size=2, env_id="digit-sum-feedback-v1", state_columns=("answer",)
        )
    assert len(server.requests) == 6  # 3 tries each
    for r in rollouts:
        assert not r.failed and r.reward == 0.0 and r.stop_condition == "max_turns"
        assert [m["role"] for m in r.completion] == ["assistant", "user", "assistant", "user", "assistant"]
        assert r.completion[1]["content"] == "Reply as <answer>N</answer>."
        shape = turn_stats(r)
        assert (shape.turns, shape.samples) == (3, 1) and shape.env_tokens > 0
        assert r.state == {"answer": int(row["task"].data.answer)}
