"""Turn a classic verifiers `RolloutOutput` into the orchestrator's `Rollout`.

This is the only module that knows the shape of verifiers' outputs: an adapter for `verifiers.v1`
envs would be a sibling of it. Invariant: anything that makes an output untrainable (an error
recorded by verifiers, a prompt too long, missing or inconsistent token ids or logprobs) becomes a
failed `Rollout` with a message saying why; nothing raises.
"""

from __future__ import annotations

import json
from typing import Any

from prime_rl.orchestrator.envs.rewards import REWARD_ERROR
from prime_rl.orchestrator.envs.routes import decode_routes
from prime_rl.orchestrator.rollout import Rollout, Turn, failed_rollout

# Large per-step objects that the orchestrator never needs after conversion.
_NOT_STATE = {"trajectory", "prompt", "completion", "timing", "metrics", "reward", "error"}


def to_json(value: Any) -> Any:
    """Messages and other pydantic objects as plain JSON values."""
    # Plain values first: this runs on every rollout's messages, on the event loop.
    if value is None or isinstance(value, str | bool | int | float):
        return value
    if isinstance(value, dict):
        return {k if isinstance(k, str) else str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json", exclude_none=True)
    return repr(value)


def _turns(output: dict[str, Any]) -> tuple[list[Turn], str | None]:
    trajectory = output.get("trajectory") or []
    if not trajectory:
        return [], "no trajectory in the env's output (was 'trajectory' requested in state_columns?)"
    turns = []
    for i, step in enumerate(trajectory):
        tokens = step.get("tokens") if isinstance(step, dict) else None
        if not tokens:
            return [], (
                f"turn {i} has no token ids: the server must return them "
                "(sampling args need logprobs=true and extra_body.return_token_ids=true)"
            )
        prompt_ids = tokens.get("prompt_ids")
        ids = tokens.get("completion_ids")
        mask = tokens.get("completion_mask")
        logprobs = tokens.get("completion_logprobs")
        if prompt_ids is None or ids is None or logprobs is None:
            return [], f"turn {i} lacks prompt ids, completion ids or logprobs"
        if mask is None:
            mask = [1] * len(ids)
        if not (len(ids) == len(mask) == len(logprobs)):
            return [], (
                f"turn {i}: {len(ids)} completion ids, {len(mask)} mask entries and {len(logprobs)} logprobs"
            )
        if any(lp is None for lp in logprobs):
            return [], f"turn {i} has missing logprobs"
        try:
            routes = decode_routes(tokens.get("routed_experts"))
        except (ValueError, TypeError) as e:
            return [], f"turn {i}: {e}"
        turns.append(
            Turn(
                list(prompt_ids),
                list(ids),
                [int(m) for m in mask],
                [float(x) for x in logprobs],
                routes=routes[0] if routes else None,
                routes_start=routes[1] if routes else 0,
            )
        )
    return turns, None


def openai_tool_call(call: Any) -> Any:
    """A tool call as OpenAI writes it (`{"id", "type", "function": {"name", "arguments"}}`); verifiers'
    outputs hold them as JSON strings of a flat `{"id", "name", "arguments"}`."""
    if isinstance(call, str):
        try:
            call = json.loads(call)
        except ValueError:
            return call
    if isinstance(call, dict) and "function" not in call and "name" in call:
        function = {"name": call["name"], "arguments": call.get("arguments")}
        return {"id": call.get("id"), "type": "function", "function": function}
    return call


def with_openai_tool_calls(messages: Any) -> Any:
    if not isinstance(messages, list):
        return messages
    return [
        {**m, "tool_calls": [openai_tool_call(c) for c in m["tool_calls"]]}
        if isinstance(m, dict) and m.get("tool_calls")
        else m
        for m in messages
    ]


def count_tools(completion: Any) -> tuple[int, int]:
    """(tool calls, tool errors) in a rollout's completion messages."""
    calls = errors = 0
    for m in completion if isinstance(completion, list) else []:
        if not isinstance(m, dict):
            continue
        if m.get("role") == "assistant":
            calls += len(m.get("tool_calls") or [])
        elif m.get("role") == "tool" and str(m.get("content") or "").lstrip().lower().startswith("error"):
            errors += 1
    return calls, errors


def from_verifiers(
    output: dict[str, Any], env_name: str, policy_version: int, state_columns: list[str]
) -> Rollout:
    example_id = output.get("example_id", -1)
    error = output.get("error")
    if error:
        message = (
            error.get("error_chain_repr") or error.get("message") if isinstance(error, dict) else str(error)
        )
        return failed_rollout(env_name, example_id, policy_version, f"env error: {message}")
    if output.get(REWARD_ERROR):
        return failed_rollout(env_name, example_id, policy_version, f"reward error: {output[REWARD_ERROR]}")
    if output.get("stop_condition") == "prompt_too_long":
        return failed_rollout(
            env_name, example_id, policy_version, "prompt too long for the server's max model len"
        )
    turns, problem = _turns(output)
    if problem:
        return failed_rollout(env_name, example_id, policy_version, problem)
    reward = output.get("reward")
    if reward is None:
        return failed_rollout(env_name, example_id, policy_version, "the env returned no reward")
    completion = with_openai_tool_calls(to_json(output.get("completion")))
    tool_calls, tool_errors = count_tools(completion)
    return Rollout(
        env_name=env_name,
        example_id=example_id,
        policy_version=policy_version,
        reward=float(reward),
        metrics={k: float(v) for k, v in (output.get("metrics") or {}).items() if isinstance(v, int | float)},
        turns=turns,
        prompt=to_json(output.get("prompt")),
        completion=completion,
        is_truncated=bool(output.get("is_truncated", False)),
        stop_condition=output.get("stop_condition"),
        state={c: to_json(output.get(c)) for c in state_columns if c not in _NOT_STATE},
        tool_calls=tool_calls,
        tool_errors=tool_errors,
    )
