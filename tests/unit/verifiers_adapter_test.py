"""verifiers' classic rollout outputs become `Rollout`s: tool calls in OpenAI's form and counted,
reward failures and untrainable outputs as failed rollouts with the reason."""

import json

from prime_rl.orchestrator.envs.rewards import REWARD_ERROR
from prime_rl.orchestrator.envs.verifiers_adapter import from_verifiers


def output(**fields) -> dict:
    tokens = {
        "prompt_ids": [1, 2],
        "completion_ids": [3],
        "completion_mask": [1],
        "completion_logprobs": [-0.1],
    }
    return {"example_id": 7, "reward": 1.0, "metrics": {}, "prompt": [], "completion": [],
            "trajectory": [{"tokens": tokens}], **fields}  # fmt: skip


def test_tool_calls_are_openai_shaped_and_counted_with_tool_errors():
    # verifiers writes a call as a JSON string of a flat {"id", "name", "arguments"}.
    call = json.dumps({"id": "c1", "name": "add", "arguments": '{"a": 1, "b": 2}'})
    completion = [
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {"role": "tool", "tool_call_id": "c1", "content": "Error: 'mul'"},
        {"role": "assistant", "content": "<answer>3</answer>"},
    ]
    r = from_verifiers(output(completion=completion), "env", 0, [])
    assert not r.failed and (r.tool_calls, r.tool_errors) == (2, 1)
    assert r.completion[0]["tool_calls"][0] == {
        "id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    }  # fmt: skip


def test_a_failed_reward_fails_the_rollout_with_its_reason():
    r = from_verifiers(output(**{REWARD_ERROR: "reward function 'judge' timed out after 5s"}), "env", 0, [])
    assert r.failed and r.error == "reward error: reward function 'judge' timed out after 5s"
    assert not from_verifiers(output(**{REWARD_ERROR: None}), "env", 0, []).failed
