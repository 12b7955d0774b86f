"""Turn a `verifiers.v1` Trace into the orchestrator's `Rollout`: the sibling of `verifiers_adapter.py`
for envs written against verifiers' v1 API (Taskset / Task / Env, Episode / Trace).

v1 keeps a trace's tokens on a message graph: each node holds the tokens its message added, with a
mask of the sampled ones and their logprobs. A model call's prompt is the tokens of the path from
the root to its assistant node, less that node's sampled tail, which is the completion. Where a
re-rendered history no longer matched, v1 forked the graph; each call still has its own path, so
the turns are exact either way and `samples.segments` splits them as for classic envs.

Invariant (as for classic outputs): anything that makes a trace untrainable (a failed call, a
scoring error, missing tokens or logprobs) becomes a failed `Rollout` saying why; nothing raises.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prime_rl.orchestrator.envs.verifiers_adapter import count_tools, to_json, with_openai_tool_calls
from prime_rl.orchestrator.rollout import Rollout, Turn, failed_rollout


def trace_turns(trace: Any) -> tuple[list[Turn], str | None]:
    """One `Turn` per model call of the trace, from its message graph."""
    turns = []
    for i, call in enumerate(trace.calls):
        if call.node is None:
            return (
                [],
                f"model call {i} failed: {call.error}" if call.error else f"model call {i} has no reply",
            )
        path, node = [], call.node
        while node is not None:
            path.append(node)
            node = trace.nodes[node].parent
        path.reverse()
        prompt = [t for n in path[:-1] for t in trace.nodes[n].token_ids]
        last = trace.nodes[call.node]
        first_sampled = next((k for k, m in enumerate(last.mask) if m), len(last.mask))
        completion = list(last.token_ids[first_sampled:])
        logprobs = list(last.logprobs)
        if not completion:
            return [], (
                f"model call {i} has no token ids: the server must return them "
                "(sampling args need logprobs=true and return_token_ids=true)"
            )
        if len(logprobs) != len(completion) or any(lp is None for lp in logprobs):
            return [], f"model call {i}: {len(completion)} completion tokens but {len(logprobs)} logprobs"
        prompt += list(last.token_ids[:first_sampled])
        # verifiers attributes a MoE server's routed experts to the nodes whose tokens they route.
        routed = [getattr(trace.nodes[n], "routed_experts", None) for n in path]
        routes = np.concatenate(routed) if routed and all(r is not None for r in routed) else None
        turns.append(
            Turn(prompt, completion, [1] * len(completion), [float(x) for x in logprobs], routes=routes)
        )
    if not turns:
        return [], "the trace made no model call"
    return turns, None


def _messages(trace: Any) -> tuple[list, list]:
    """(prompt, completion) messages, JSON-ready: the prompt is what preceded the first reply."""
    messages = [to_json(m) for m in trace.messages]
    first = next(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
        len(messages),
    )
    return messages[:first], with_openai_tool_calls(messages[first:])


def _state(trace: Any, columns: list[str]) -> dict[str, Any]:
    """`state_columns` from the trace: its `info` first, then its typed state, then its task data."""
    out = {}
    for c in columns:
        for source in (trace.info, trace.state, getattr(trace.task, "data", None)):
            value = source.get(c) if isinstance(source, dict) else getattr(source, c, None)
            if value is not None:
                out[c] = to_json(value)
                break
    return out


def from_v1_trace(
    trace: Any, env_name: str, example_id: int | str, policy_version: int, state_columns: list[str]
) -> Rollout:
    if trace.errors:
        message = "; ".join(f"{e.type}: {e.message}" for e in trace.errors)
        return failed_rollout(env_name, example_id, policy_version, f"env error: {message}")
    if trace.stop_condition == "context_length":
        return failed_rollout(
            env_name, example_id, policy_version, "prompt too long for the server's max model len"
        )
    turns, problem = trace_turns(trace)
    if problem:
        return failed_rollout(env_name, example_id, policy_version, problem)
    if any(r is None for r in trace.rewards.values()):
        missing = [k for k, r in trace.rewards.items() if r is None]
        return failed_rollout(env_name, example_id, policy_version, f"reward error: no score for {missing}")
    prompt, completion = _messages(trace)
    tool_calls, tool_errors = count_tools(completion)
    metrics = {k: float(v) for k, v in trace.metrics.items() if isinstance(v, int | float)}
    metrics.update({k: float(r.score) for k, r in trace.rewards.items()})
    return Rollout(
        env_name=env_name,
        example_id=example_id,
        policy_version=policy_version,
        reward=float(trace.reward),
        metrics=metrics,
        turns=turns,
        prompt=prompt,
        completion=completion,
        is_truncated=bool(trace.is_truncated),
        stop_condition=trace.stop_condition,
        state=_state(trace, state_columns),
        tool_calls=tool_calls,
        tool_errors=tool_errors,
    )
