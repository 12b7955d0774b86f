"""Stop a run whose rollouts keep failing, with one line, instead of spinning on failures forever.

Invariant: per env (training and evaluation each), once `limit` groups in a row finished with no
rollout that could train because every one failed (an env exception, a reward or teacher that could
not score, a request that timed out or was refused, an untrainable reply), `FailureStreak.record`
raises `RolloutsFailing`, naming the env, the most common reason and the key that bounds it. A group
with any surviving rollout resets the env's count. Failures to reach a server at all (connection
refused or dropped) do not count: they are the server health check's (`client.health_timeout_s`),
and a server that restarts fails every group that was in flight on it at once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from prime_rl.orchestrator.rollout import Rollout, failure_reason

UNREACHABLE = ("APIConnectionError", "ConnectError", "ConnectionRefusedError", "RemoteProtocolError",
               "ReadError", "ConnectionResetError")  # fmt: skip
"""Exception names of a request that never reached a live server (timeouts are not among them)."""


class RolloutsFailing(RuntimeError):
    """An env's groups kept failing entirely: the run cannot train on it."""


SCORERS = ("TeacherError", "RewardModelError")
"""Failures of the teacher's or a reward model's server: no health check watches those, so they count."""


def unreachable(error: str) -> bool:
    """The failure is a policy request that never reached a live server (not a timeout, not an
    answer, not the teacher or a reward model)."""
    names = failure_reason(error).split(" -> ")
    return (
        any(n in UNREACHABLE for n in names)
        and not any("Timeout" in n for n in names)
        and not any(n in SCORERS for n in names)
    )


@dataclass
class FailureStreak:
    """Groups in a row, per env, whose every rollout failed (see the module's invariant)."""

    limit: int
    key: str = "orchestrator.max_failed_groups"
    what: str = "env"
    groups: Counter = field(default_factory=Counter)
    reasons: dict[str, Counter] = field(default_factory=dict)
    example: dict[str, str] = field(default_factory=dict)
    """Per env, the first line of the most recent counted failure, to show with its reason."""

    def record(self, env: str, rollouts: list[Rollout], group_failed: bool | None = None) -> None:
        """Count one finished group; `group_failed` overrides "every rollout failed" (group scoring
        drops a group on any failure). Raises `RolloutsFailing` at the limit."""
        failed = all(r.failed for r in rollouts) if group_failed is None else group_failed
        if not failed:
            self.groups[env] = 0
            self.reasons.pop(env, None)
            return
        errors = [r.error or "" for r in rollouts if r.failed]
        if errors and all(unreachable(e) for e in errors):
            return
        self.groups[env] += 1
        reasons = self.reasons.setdefault(env, Counter())
        for e in errors:
            reasons[failure_reason(e)] += 1
            self.example[env] = e.splitlines()[0][:200] if e else ""
        if self.groups[env] >= self.limit:
            raise RolloutsFailing(self.message(env))

    def message(self, env: str) -> str:
        reasons = self.reasons.get(env, Counter())
        total = sum(reasons.values())
        reason, count = reasons.most_common(1)[0] if reasons else ("unknown", 0)
        return (
            f"{self.what} '{env}': the last {self.groups[env]} groups failed entirely ({total} rollouts; "
            f'most common reason: {reason}, {count} times, e.g. "{self.example.get(env, "")}"); stopping at '
            f"{self.key} = {self.limit} (each failure is in the orchestrator's log)"
        )
