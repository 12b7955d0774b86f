"""The orchestrator's own rollout type, independent of the env library that produced it.

Invariant: a `Rollout` either has `error` set (it failed and never trains) or has at least one turn
whose token ids, masks and sampling logprobs have matching lengths.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Turn:
    """One model call: the exact prompt tokens sent and the completion tokens sampled."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_mask: list[int]
    completion_logprobs: list[float]
    teacher_logprobs: list[float] | None = None
    """The teacher's logprob of each completion token, when a teacher scored it (distillation)."""
    routes: Any = None
    """A MoE server's routed experts for this call (numpy [rows, layers, top-k]): row i is the
    token at position `routes_start + i` of prompt + completion. The server returns none for the
    last completion token, which it never forwarded. None: the server returned no routes."""
    routes_start: int = 0
    version: int | None = None
    """The policy version the server held when this call's completion finished (None: unknown)."""


@dataclass
class Rollout:
    """One finished attempt at an example."""

    env_name: str
    example_id: int | str
    policy_version: int
    """The policy version (trainer step of the weights) that was served when it started: the
    oldest among its tokens (a weight update during the rollout does not interrupt it)."""
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    turns: list[Turn] = field(default_factory=list)
    prompt: Any = None
    """The prompt messages, JSON-ready (for the rollouts log)."""
    completion: Any = None
    """The completion messages, JSON-ready (for the rollouts log)."""
    is_truncated: bool = False
    stop_condition: str | None = None
    error: str | None = None
    """Why the rollout failed (exception, HTTP error, timeout, env error, missing tokens), or None."""
    state: dict[str, Any] = field(default_factory=dict)
    """The env's `state_columns`, JSON-ready."""
    tool_calls: int = 0
    """Tool calls the model made (parsed by the server), over all turns."""
    tool_errors: int = 0
    """Tool results that report an error (a tool message whose text starts with "Error")."""
    policy_end: int | None = None
    """The policy version when its last turn finished (where the server says): with
    `policy_version`, the span of policies that sampled it (verifiers' `PolicySpan`)."""
    sandbox: dict[str, int] = field(default_factory=dict)
    """Its sandboxed tool calls that failed, by how: 'timeouts' (past the deadline), 'oom' (out of
    memory), 'killed' (died: a limit, a crash)."""
    drifted_turns: int = 0
    """Turns whose history, re-rendered from messages by the chat template, differs from the
    tokens the model saw (token-in kept the latter): each would have split the rollout."""

    @property
    def policy_span(self) -> tuple[int, int]:
        """(start, end): the policy version at dispatch and at its last completion."""
        end = self.policy_end if self.policy_end is not None else self.policy_version
        return self.policy_version, max(end, self.policy_version)

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(t.completion_ids) for t in self.turns)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.turns[0].prompt_ids) if self.turns else 0


def failed_rollout(env_name: str, example_id: int | str, policy_version: int, error: str) -> Rollout:
    return Rollout(env_name=env_name, example_id=example_id, policy_version=policy_version, error=error)


_EXCEPTION = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Timeout|Exit))\b")


def failure_reason(error: str) -> str:
    """A failure's kind, without its details: the exception names of its chain, e.g.
    `APIConnectionError -> ReadError`, so that failures of one cause count together."""
    names = list(dict.fromkeys(_EXCEPTION.findall(error)))
    return " -> ".join(names) if names else error[:80]


def most_common_failure(failures: list[Rollout]) -> tuple[str, int]:
    """The most common failure reason among `failures` (not empty) and how many share it."""
    return Counter(failure_reason(r.error or "") for r in failures).most_common(1)[0]
