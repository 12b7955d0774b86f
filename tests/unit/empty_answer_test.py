"""An answer the model finished is a rollout even when its text is empty: scored by the env's rubric
and trained on, not failed and replaced (verifiers refuses such a response on its own)."""

import asyncio

import pytest

from fake_server import FakeServer, Reply
from helpers.groups import run_group_on
from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.envs.client import answered, make_vf_client


def test_an_empty_answer_ended_by_the_model_is_scored_and_trainable():
    with FakeServer(lambda req, i: Reply(text="", eos=True)) as server:
        rollouts, _ = run_group_on("reverse-text", server.base_url)
    assert [r.failed for r in rollouts] == [False] * 4, [r.error for r in rollouts]
    assert [r.reward for r in rollouts] == [0.0] * 4  # reverse-text's rubric on an empty answer
    assert all(r.num_completion_tokens == 1 for r in rollouts)  # the end-of-sequence token, trained on


def test_a_response_without_a_finished_choice_is_still_refused():
    import verifiers as vf

    client = make_vf_client(
        "http://nowhere.invalid/v1", ClientConfig(base_urls=["http://nowhere.invalid/v1"])
    )
    for response in (None, type("R", (), {"choices": None})(), type("R", (), {"choices": []})()):
        assert not answered(response)
        with pytest.raises(vf.InvalidModelResponseError):  # (its EmptyModelResponseError included)
            asyncio.run(client.raise_from_native_response(response))


@pytest.mark.parametrize("reason", ["stop", "length"])
def test_a_choice_ended_by_end_of_sequence_or_max_tokens_is_an_answer(reason):
    choice = type("C", (), {"finish_reason": reason})()
    assert answered(type("R", (), {"choices": [choice]})())
    assert not answered(type("R", (), {"choices": [choice, choice]})())  # one choice per rollout
