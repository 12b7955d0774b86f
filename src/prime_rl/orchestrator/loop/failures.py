"""Stop a run whose rollouts keep failing, with one line, instead of spinning on failures forever.

Invariant: per env (training and evaluation each), a group counts as failed when every one of its
rollouts failed (an env exception, a reward, teacher or reward model that could not score, a
request that timed out or was refused, an untrainable reply); a group with any surviving rollout
resets the env's count. `FailureStreak.record` raises `RolloutsFailing`, naming the env, the most
common reason and the key that bounds it, once
- `limit` groups in a row failed with at least one failure that reached a server or the env, or
- every group failed for `unreachable_s` seconds only because no server could be reached
  (connection refused or dropped): a server restarting fails every group in flight on it at once,
  so those failures are bounded by time, as an absent server is (`client.health_timeout_s`).
Groups failed only because their env worker died neither count nor reset: one death fails every
group the worker was running at once, and deaths are bounded by the worker pool
(`workers.MAX_QUICK_DEATHS`).
`RolloutsFailing.retryable` says whether the most common reason is on a server's side (HTTP 5xx,
timeouts, unreachable: a restart may help, exit status 1) or the env's (exit status 2, never retried).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

from prime_rl.orchestrator.rollout import Rollout, failure_reason

SERVER_SILENT = "ServerSilentError"
"""The failure reason of the rollouts of a group whose server stopped answering (`health.py`)."""

SERVER_LOST = "ServerLostError"
"""The failure reason of the rollouts of a group whose server died under it (vLLM's engine in the
orchestrator's process, whose death the orchestrator sees): its example is dispatched again."""
UNREACHABLE = (
    SERVER_LOST,
    "APIConnectionError",
    "ConnectError",
    "ConnectionRefusedError",
    "RemoteProtocolError",
    "ReadError",
    "ConnectionResetError",
    SERVER_SILENT,
)
"""Exception names of a request that never reached a live server (timeouts are not among them)."""

WORKER_DIED = "EnvWorkerDied"
"""The failure reason of the rollouts of a group whose env worker died (`workers.py`)."""

SERVER_SIDE = (
    *UNREACHABLE,
    "InternalServerError",
    "APIStatusError",
    "ServiceUnavailableError",
    "APITimeoutError",
    "TimeoutError",
    "ReadTimeout",
    "TeacherError",
    "RewardModelError",
)
"""Exception names of failures a server caused (a restart of it may cure them)."""


class RolloutsFailing(RuntimeError):
    """An env's groups kept failing entirely: the run cannot train on it."""

    def __init__(self, message: str, retryable: bool):
        super().__init__(message)
        self.retryable = retryable


def _names(error: str) -> list[str]:
    return failure_reason(error).split(" -> ")


def unreachable(error: str) -> bool:
    """The failure is a request that never reached a live server (not a timeout, not an answer)."""
    names = _names(error)
    return any(n in UNREACHABLE for n in names) and not any("Timeout" in n for n in names)


def server_side(reason: str) -> bool:
    return any(n in SERVER_SIDE for n in reason.split(" -> "))


@dataclass
class FailureStreak:
    """Failed groups in a row, per env (see the module's invariant)."""

    limit: int
    unreachable_s: float = 600.0
    key: str = "orchestrator.max_failed_groups"
    what: str = "env"
    groups: Counter = field(default_factory=Counter)
    reasons: dict[str, Counter] = field(default_factory=dict)
    example: dict[str, str] = field(default_factory=dict)
    """Per env, the first line of the most recent counted failure, to show with its reason."""
    unreachable_since: dict[str, float] = field(default_factory=dict)
    """Per env, since when every group failed only for want of a reachable server."""

    def record(self, env: str, rollouts: list[Rollout]) -> None:
        """Count one finished group; raises `RolloutsFailing` at a bound."""
        if not all(r.failed for r in rollouts):
            self.groups[env] = 0
            self.reasons.pop(env, None)
            self.unreachable_since.pop(env, None)
            return
        errors = [r.error or "" for r in rollouts]
        if all(e.startswith(WORKER_DIED) for e in errors):
            return
        if all(unreachable(e) for e in errors):
            now = time.monotonic()
            since = self.unreachable_since.setdefault(env, now)
            if since < now and now - since >= self.unreachable_s:
                reason, _ = Counter(failure_reason(e) for e in errors).most_common(1)[0]
                raise RolloutsFailing(
                    f"{self.what} '{env}': no server could be reached for any of its groups for "
                    f"{now - since:.0f} s (most common reason: {reason}); stopping at "
                    f"client.health_timeout_s = {self.unreachable_s:g}",
                    retryable=True,
                )
            return
        self.groups[env] += 1
        reasons = self.reasons.setdefault(env, Counter())
        for e in errors:
            reasons[failure_reason(e)] += 1
            self.example[env] = e.splitlines()[0][:200] if e else ""
        if self.groups[env] >= self.limit:
            reason = reasons.most_common(1)[0][0]
            raise RolloutsFailing(self.message(env), retryable=server_side(reason))

    def message(self, env: str) -> str:
        reasons = self.reasons.get(env, Counter())
        total = sum(reasons.values())
        reason, count = reasons.most_common(1)[0] if reasons else ("unknown", 0)
        return (
            f"{self.what} '{env}': the last {self.groups[env]} groups failed entirely ({total} rollouts; "
            f'most common reason: {reason}, {count} times, e.g. "{self.example.get(env, "")}"); stopping at '
            f"{self.key} = {self.limit} (each failure is in the orchestrator's log)"
        )
