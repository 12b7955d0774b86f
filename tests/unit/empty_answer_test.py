"""An answer the model finished is a rollout even when its text is empty: scored by the env's reward
and trained on (its end-of-turn token), not failed and replaced."""

from fake_server import FakeServer, Reply
from helpers.groups import run_group_on


def test_an_empty_answer_ended_by_the_model_is_scored_and_trainable():
    with FakeServer(lambda req, i: Reply(text="")) as server:
        rollouts, _ = run_group_on("reverse-text", server.base_url)
    assert [r.failed for r in rollouts] == [False] * 4, [r.error for r in rollouts]
    assert [r.reward for r in rollouts] == [0.0] * 4  # reverse-text's reward on an empty answer
    assert all(r.num_completion_tokens == 1 for r in rollouts)  # the end-of-turn token, trained on
