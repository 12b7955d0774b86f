"""Turn a verifiers v1 `Trace` into the orchestrator's `Rollout`: the only module that knows the
shape of verifiers' traces.

v1 keeps a trace's tokens on a message graph: each node holds the tokens its message added, with
a mask of the sampled ones and their logprobs. A model call's prompt is the tokens of the path from
the root to its assistant node, less that node's sampled tail, which is the completion. With
token-in turns (`agent.py`) each call's path extends the previous call's, so a rollout's turns
merge into one sample (`samples.segments`).

Invariant: anything that makes a trace untrainable (a failed call, an env or scoring error,
missing tokens or logprobs, a reward that was not scored) becomes a failed `Rollout` saying why;
nothing raises.
"""

from __future__ import annotations

from typing import Any

from prime_rl.orchestrator.rollout import Rollout, Turn, failed_rollout


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


def openai_message(message: dict) -> dict:
    """A message as OpenAI writes it: verifiers keeps a tool call flat (`{"id", "name",
    "arguments"}`), OpenAI nests it (`{"id", "type", "function": {"name", "arguments"}}`)."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    nested = [
        {
            "id": c.get("id"),
            "type": "function",
            "function": {"name": c.get("name"), "arguments": c.get("arguments")},
        }
        if isinstance(c, dict) and "function" not in c
        else c
        for c in calls
    ]
    return {**message, "tool_calls": nested}


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


def trace_turns(
    trace: Any, routes: dict[int, Any] | None = None, versions: dict[int, int] | None = None
) -> tuple[list[Turn], str | None]:
    """One `Turn` per model call of the trace, from its message graph; `routes` are a MoE server's
    routed experts of each call and `versions` the policy version it finished at (both by the
    call's assistant node)."""
    turns = []
    for i, call in enumerate(trace.calls):
        if call.node is None:
            return [], (
                f"model call {i} failed: {call.error.type}: {call.error.message}"
                if call.error
                else f"model call {i} has no reply"
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
            return [], f"model call {i} has no completion tokens"
        if len(logprobs) != len(completion) or any(lp is None for lp in logprobs):
            return [], f"model call {i}: {len(completion)} completion tokens but {len(logprobs)} logprobs"
        prompt += list(last.token_ids[:first_sampled])
        turns.append(
            Turn(
                prompt,
                completion,
                [1] * len(completion),
                [float(x) for x in logprobs],
                routes=(routes or {}).get(call.node),
                version=(versions or {}).get(call.node),
            )
        )
    if not turns:
        return [], "the trace made no model call"
    return turns, None


def _messages(trace: Any) -> tuple[list, list]:
    """(prompt, completion) messages, JSON-ready: the prompt is what preceded the first reply."""
    messages = [openai_message(to_json(m)) for m in trace.messages]
    first = next(
        (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
        len(messages),
    )
    return messages[:first], messages[first:]


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


def from_trace(
    trace: Any,
    env_name: str,
    example_id: int | str,
    policy_version: int,
    state_columns: list[str],
    audit: Any = None,
) -> Rollout:
    """`audit`: what token-in recorded of the trace's turns (`agent.TurnAudit`)."""
    failed_call = next((c for c in trace.calls if c.error is not None), None)
    if failed_call is not None:  # the server's failure (it may be retried elsewhere), not the env's
        error = failed_call.error
        return failed_rollout(
            env_name, example_id, policy_version, f"model call failed: {error.type}: {error.message}"
        )
    if trace.errors:
        if trace.errors[-1].type == "RewardError":
            return failed_rollout(
                env_name, example_id, policy_version, f"reward error: {trace.errors[-1].message}"
            )
        message = "; ".join(f"{e.type}: {e.message}" for e in trace.errors)
        return failed_rollout(env_name, example_id, policy_version, f"env error: {message}")
    turns, problem = trace_turns(trace, getattr(audit, "routes", None), getattr(audit, "versions", None))
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
        policy_end=max((t.version for t in turns if t.version is not None), default=None),
        drifted_turns=getattr(audit, "drifted", 0),
        sandbox=dict(getattr(audit, "sandbox", {})),
    )
