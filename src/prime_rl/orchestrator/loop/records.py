"""What a step leaves on disk besides its batch: one JSON line per rollout (trained, filtered, failed
or dropped), and the per-rollout shape metrics of multi-turn and tool envs.

Invariant: a record holds everything the rollouts log promises (prompt, completion, per-turn token
counts, reward, advantage, whether it trained, error, the env's state_columns) and nothing that
needs the env to read back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from prime_rl.orchestrator.loop.pipeline import FinishedGroup, ScoredGroup
from prime_rl.orchestrator.loop.samples import segments, turn_stats
from prime_rl.orchestrator.rollout import Rollout
from prime_rl.runtime.disk import writing
from prime_rl.runtime.monitor import stats
from prime_rl.sandbox.tools_host import FAILURES


def turn_metrics(env: str, rollouts: list[Rollout]) -> dict[str, float]:
    """Per-rollout means of the shape of multi-turn and tool rollouts (see `samples.TurnStats`)."""
    shapes = [turn_stats(r) for r in rollouts]
    n = len(rollouts)
    multi = [r for r, s in zip(rollouts, shapes, strict=True) if s.turns > 1]
    m = {
        **stats(f"turns/{env}", [float(s.turns) for s in shapes]),
        f"samples_per_rollout/{env}": sum(s.samples for s in shapes) / n,
        f"tokens/{env}/model": sum(s.model_tokens for s in shapes) / n,
        f"tokens/{env}/env": sum(s.env_tokens for s in shapes) / n,
        f"tool_calls/{env}": sum(r.tool_calls for r in rollouts) / n,
        f"tool_errors/{env}": sum(r.tool_errors for r in rollouts) / n,
        # Token-in: the turns whose re-rendered history would have differed from what the model saw.
        f"drifted_turns/{env}": sum(r.drifted_turns for r in rollouts) / n,
        # Sandboxed tool calls that failed this step, counted (not averaged): each is worth a look.
        **{f"sandbox/{env}/{how}": sum(r.sandbox.get(how, 0) for r in rollouts) for how in FAILURES},
        **stats(f"policy_span/{env}", [float(r.policy_span[1] - r.policy_span[0]) for r in rollouts]),
    }
    if multi:
        m[f"truncated_multi_turn/{env}"] = sum(r.is_truncated for r in multi) / len(multi)
    return m


def rollout_record(r: Rollout, step: int, advantage: float | None, trained: bool | None) -> dict[str, Any]:
    return {
        "step": step,
        "env": r.env_name,
        "example_id": r.example_id,
        "policy_version": r.policy_version,
        # verifiers' PolicySpan: the policy version at dispatch and when its last turn finished.
        "policy": dict(zip(("start", "end"), r.policy_span, strict=True)),
        "reward": r.reward,
        "advantage": advantage,
        "trained": trained,
        "prompt": r.prompt,
        "completion": r.completion,
        "completion_tokens": r.num_completion_tokens,
        # Per model call: its prompt and sampled token counts and the sample it trains in.
        "turns": turn_records(r),
        "is_truncated": r.is_truncated,
        "stop_condition": r.stop_condition,
        "metrics": r.metrics,
        "error": r.error,
        **r.state,
    }


def turn_records(r: Rollout) -> list[dict[str, int | None]]:
    """Per model call: its token counts, the sample it trains in, and the policy version it finished
    at (a turn sampled after a weight update mid-rollout has a later one than the rollout's start)."""
    return [
        {
            "prompt_tokens": len(t.prompt_ids),
            "completion_tokens": len(t.completion_ids),
            "sample": i,
            "version": t.version,
        }
        for i, seg in enumerate(segments(r))
        for t in seg
    ]


_JSONL = msgspec.json.Encoder(enc_hook=str)  # several times json.dumps; NaN is written as null


def write_jsonl(path: Path, records: list[dict[str, Any]], what: str = "rollouts") -> None:
    with writing(path, what):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(_JSONL.encode_lines(records))


def step_records(
    step: int, groups: list[ScoredGroup], failures: list[Rollout], uniform: list[FinishedGroup]
) -> list[dict[str, Any]]:
    """A step's rollouts log: its groups' rollouts (trained or filtered), the groups dynamic sampling
    dropped, and the rollouts that failed since the previous step."""
    records = [
        rollout_record(r, step, a, i not in g.filtered)
        for g in groups
        for i, (r, a) in enumerate(zip(g.rollouts, g.advantages, strict=True))
    ]
    records += [rollout_record(r, step, None, False) for g in uniform for r in g.rollouts]
    records += [rollout_record(r, step, None, None) for r in failures]
    return records
