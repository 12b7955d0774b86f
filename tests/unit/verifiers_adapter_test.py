"""verifiers v1 traces become `Rollout`s: tool calls in OpenAI's form and counted, failed model calls
and unscored rewards as failed rollouts with the reason."""

import json
from pathlib import Path

from helpers.scripted import play

TOOL_MODEL = str(Path(__file__).parents[2] / "models" / "tool_add-tiny")


def call(a, b) -> str:
    return f'<tool_call>\n{{"name": "add", "arguments": {json.dumps({"a": a, "b": b})}}}\n</tool_call>'


def test_tool_calls_are_openai_shaped_and_counted_with_tool_errors():
    (r,), _ = play(
        "tool-add",
        [call(1, 2), '<tool_call>\n{"name": "mul", "arguments": {}}\n</tool_call>', "3"],
        TOOL_MODEL,
    )
    assert not r.failed and (r.tool_calls, r.tool_errors) == (2, 1)
    first = r.completion[0]["tool_calls"][0]
    assert first["type"] == "function" and first["function"] == {
        "name": "add",
        "arguments": '{"a": 1, "b": 2}',
    }
    assert r.completion[1] == {"role": "tool", "tool_call_id": first["id"], "content": "3", "name": "add"}
    assert r.completion[3]["content"].startswith("Error: no tool named 'mul'")


def test_a_failed_model_call_fails_the_rollout_with_its_reason():
    class Refusing:
        async def sample(self, prompt_ids, args, n=1):
            raise ConnectionRefusedError("no server")

    import asyncio

    from prime_rl.engine.sampling import SamplingArgs
    from prime_rl.orchestrator.envs.renderer import Renderer
    from prime_rl.orchestrator.envs.v1_env import load_v1_env

    env = load_v1_env("reverse-text", {"num_examples": 2})
    rollouts = asyncio.run(
        env.run_group(
            env.first, 0, 2, Refusing(), Renderer.for_model(TOOL_MODEL), "m", SamplingArgs(), "rt", 0, [], 10
        )
    )
    assert [r.error for r in rollouts] == ["model call failed: ConnectionRefusedError: no server"] * 2
