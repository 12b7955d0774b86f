"""verifiers v1 envs through the orchestrator's group runner: one rollout per episode with the exact
tokens of its model calls, the group's first turns as one request, and failures (a raising reward,
a server error, a timeout) as failed rollouts that say why."""

from fake_server import FakeServer, Reply, tokenizer
from helpers.groups import run_groups
from prime_rl.orchestrator.envs.v1_env import V1Env
from prime_rl.orchestrator.loop.samples import turn_stats


def test_a_v1_group_is_one_request_and_its_rollouts_carry_tokens_reward_and_state():
    with FakeServer() as server:
        env, (task,), rollouts = run_groups(server.base_url, "v1_test_env", size=3, state_columns=("word",))
    assert isinstance(env.vf_env, V1Env) and sum(1 for _ in env.examples) == 6
    (request,) = server.requests  # the three identical first turns: one request for n = 3
    assert request["n"] == 3 and request["logprobs"] == 0 and request["return_token_ids"] is True
    assert len(rollouts) == 3 and len({id(r) for r in rollouts}) == 3
    word = task.data.prompt
    reply = [*tokenizer().encode(word[::-1], add_special_tokens=False), tokenizer().eos_token_id]
    for r in rollouts:
        assert not r.failed, r.error
        assert r.reward == 1.0 and r.metrics == {"reversed_word": 1.0, "reply_length": 5.0}
        assert r.policy_version == 2 and r.example_id == task.data.idx and r.state == {"word": word}
        (turn,) = r.turns  # the prompt the server got, then what it sampled, with its logprobs
        assert turn.prompt_ids == request["prompt"]
        assert turn.completion_ids == reply
        assert turn.completion_logprobs == [-0.5] * len(reply) and turn.completion_mask == [1] * len(reply)
        assert r.completion == [{"role": "assistant", "content": word[::-1]}]


def test_a_raising_v1_reward_fails_the_rollout_with_the_reason():
    with FakeServer() as server:
        _, _, rollouts = run_groups(server.base_url, "v1_test_env", {"mode": "raise"}, size=3)
    assert all(
        r.failed and r.error.startswith("reward error:") and "judge said no" in r.error for r in rollouts
    )


def test_a_server_error_fails_each_v1_rollout():
    with FakeServer(lambda req, i: Reply(status=500)) as server:
        _, _, rollouts = run_groups(server.base_url, "v1_test_env", size=3)
    assert len(rollouts) == 3 and all(r.failed and "500" in r.error for r in rollouts)
    assert all(r.error.startswith("model call failed: InternalServerError") for r in rollouts)


def test_a_v1_episode_past_the_client_timeout_fails():
    with FakeServer(lambda req, i: Reply(delay_s=5)) as server:
        _, _, rollouts = run_groups(server.base_url, "v1_test_env", size=2, timeout_s=0.5)
    assert len(rollouts) == 2 and all(r.failed and "TimeoutError" in r.error for r in rollouts)


def test_a_multi_turn_v1_env_plays_its_turns_and_merges_them_into_one_sample():
    # digit-sum-feedback's own Env drives the turns; the fake server never answers in the format.
    with FakeServer() as server:
        _, (task,), rollouts = run_groups(
            server.base_url, "digit-sum-feedback", {"num_examples": 4}, size=2, state_columns=("answer",)
        )
    assert len(server.requests) == 5  # the first tries as one request, then 2 more tries each
    for r in rollouts:
        assert not r.failed and r.reward == 0.0 and r.stop_condition == "user_closed" and not r.is_truncated
        assert [m["role"] for m in r.completion] == ["assistant", "user", "assistant", "user", "assistant"]
        assert r.completion[1]["content"] == "Reply as <answer>N</answer>."
        shape = turn_stats(r)
        assert (shape.turns, shape.samples) == (3, 1) and shape.env_tokens > 0
        assert r.state == {"answer": int(task.data.answer)}


def test_a_group_reward_scores_the_group_together_and_a_failure_fails_all():
    with FakeServer(distinct_choices=True) as server:  # replies "x", "x+", "x++", ...
        env, _, rollouts = run_groups(server.base_url, "group-scored-env", size=4)
    assert env.group_scoring
    lengths = [len(r.completion[0]["content"]) for r in rollouts]
    assert [r.reward for r in rollouts] == [n / max(lengths) for n in lengths]
    # One request per rollout, the second refused: the group reward cannot score the others alone.
    with FakeServer(lambda req, i: Reply(status=500) if i == 1 else Reply()) as server:
        _, _, rollouts = run_groups(server.base_url, "group-scored-env", size=4, merge=False)
    assert all(r.failed and r.error.startswith("group scoring: model call failed") for r in rollouts)
