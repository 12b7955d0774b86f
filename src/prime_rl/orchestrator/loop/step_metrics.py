"""A step's metrics, as pure functions of what the step built and counted, and its console line.

Invariant: every env gets the same keys each step (`<name>/<env>` and `<name>/all`); a value with
nothing to average over is left out (never NaN), and the console line says "no samples" for it.
"""

from __future__ import annotations

from typing import Any

from prime_rl.orchestrator.loop.pipeline import FinishedGroup, ScoredGroup
from prime_rl.orchestrator.loop.records import turn_metrics
from prime_rl.orchestrator.loop.scheduler import BUCKETS, Accounting
from prime_rl.runtime.monitor import stats
from prime_rl.sandbox.tools_host import FAILURES


def rollout_metrics(step: int, groups: list[ScoredGroup], envs: list[str]) -> dict[str, Any]:
    """Reward, advantage, lengths, off-policy lag, truncation, turns and the env's own metrics of the
    step's trained-or-filtered rollouts, per env and over all."""
    rollouts = [(g, r, a) for g in groups for r, a in zip(g.rollouts, g.advantages, strict=True)]
    m: dict[str, Any] = {}
    metric_names = sorted({k for _, r, _ in rollouts for k in r.metrics})
    for env in ["all", *envs]:
        mine = [(r, a) for g, r, a in rollouts if env == "all" or g.env_name == env]
        rs = [r for r, _ in mine]
        m.update(stats(f"reward/{env}", [r.reward for r in rs]))
        m.update(stats(f"advantage/{env}", [a for _, a in mine]))
        m.update(stats(f"seq_len/{env}", [float(r.num_prompt_tokens + r.num_completion_tokens) for r in rs]))
        m.update(stats(f"completion_len/{env}", [float(r.num_completion_tokens) for r in rs]))
        m.update(stats(f"off_policy_lag/{env}", [float(step - r.policy_version) for r in rs]))
        if rs:
            m[f"truncated/{env}"] = sum(r.is_truncated for r in rs) / len(rs)
            m.update(turn_metrics(env, rs))
        # The env's own metric functions (e.g. a format check), averaged over its rollouts.
        for name in metric_names:
            values = [r.metrics[name] for r in rs if name in r.metrics]
            if values:
                m[f"metric/{name}/{env}"] = sum(values) / len(values)
    return m


def accounting_metrics(now: Accounting, before: Accounting, envs: list[str]) -> dict[str, int]:
    """Rollouts dispatched, trained, filtered, failed and stale during the step, per env and over all,
    and the totals so far."""
    m = {}
    for bucket in ("dispatched", *BUCKETS):
        a = now.dispatched if bucket == "dispatched" else now.buckets[bucket]
        b = before.dispatched if bucket == "dispatched" else before.buckets[bucket]
        for env in envs:
            m[f"rollouts/{env}/{bucket}"] = a[env] - b[env]
        m[f"rollouts/all/{bucket}"] = sum(a.values()) - sum(b.values())
        m[f"rollouts/all/{bucket}_total"] = sum(a.values())
    return m


def dynamic_sampling_metrics(uniform: list[FinishedGroup], short: bool, envs: list[str]) -> dict[str, float]:
    m: dict[str, float] = {
        f"dynamic_sampling/dropped/{env}": sum(len(g.rollouts) for g in uniform if g.env_name == env)
        for env in envs
    }
    m["dynamic_sampling/dropped/all"] = sum(len(g.rollouts) for g in uniform)
    m["dynamic_sampling/short"] = float(short)
    return m


def batch_metrics(per_rank, seq_len: int) -> dict[str, float]:
    """Micro-batches per rank, tokens, and how full the packed micro-batches are."""
    tokens = sum(mb.num_tokens for mbs in per_rank for mb in mbs)
    return {
        "batch/micro_batches_per_rank": len(per_rank[0]),
        "batch/tokens": tokens,
        "batch/packing_efficiency": tokens / (seq_len * len(per_rank) * max(1, len(per_rank[0]))),
    }


POOL_STATES = ("serving", "joining", "draining", "down")


def pool_metrics(servers, prev_groups: dict[str, int]) -> dict[str, Any]:
    """The pool now: how many members are in each state, and per member the groups
    dispatched to it since the last step (`prev_groups`: name -> its count then) and the step of the
    weights it was last seen serving."""
    m: dict[str, Any] = {f"pool/{k}": 0 for k in POOL_STATES}
    for s in servers:
        m[f"pool/{s.state}"] += 1
        m[f"pool/{s.name}/groups"] = s.groups - prev_groups.get(s.name, 0)
        if s.step is not None:
            m[f"pool/{s.name}/step"] = s.step
    return m


def pool_part(m: dict[str, Any]) -> str:
    """The step line's view of the pool, when it has more than one member or one joins or leaves."""
    if sum(m.get(f"pool/{k}", 0) for k in POOL_STATES) <= 1 and not (
        m.get("pool/joining") or m.get("pool/draining")
    ):
        return ""
    counts = ", ".join(f"{m[f'pool/{k}']} {k}" for k in POOL_STATES if m.get(f"pool/{k}"))
    groups = ", ".join(
        f"{key.removeprefix('pool/').removesuffix('/groups')} {n}"
        for key, n in m.items()
        if key.startswith("pool/") and key.endswith("/groups")
    )
    return f" | pool {counts} (groups: {groups})"


def drift_part(m: dict[str, Any], envs: list[str]) -> str:
    """The step line's view of token-in, when some env's chat template rewrote history: the turns
    per rollout that re-rendering would have split off (token-in kept each rollout one sample)."""
    drifted = [(e, m.get(f"drifted_turns/{e}", 0.0)) for e in envs]
    drifted = [f"{e} {v:.2f}" for e, v in drifted if v]
    return f" | history drift per rollout: {', '.join(drifted)} (kept one sample)" if drifted else ""


def sandbox_part(m: dict[str, Any], envs: list[str]) -> str:
    """The step line's view of the sandbox: tool calls that failed in it, and envs whose tools run
    unsandboxed (`sandbox.runtime = "none"`), named every step."""
    failed = [
        f"{e} {how} {m[f'sandbox/{e}/{how}']}"
        for e in envs
        for how in FAILURES
        if m.get(f"sandbox/{e}/{how}")
    ]
    off = [e for e in envs if m.get(f"sandbox/{e}/off")]
    parts = ([f"sandbox failures: {', '.join(failed)}"] if failed else []) + (
        [f"TOOLS UNSANDBOXED: {', '.join(off)}"] if off else []
    )
    return "".join(f" | {p}" for p in parts)


def step_line(step: int, m: dict[str, Any], envs: list[str]) -> str:
    def reward(env: str) -> str:
        mean = m.get(f"reward/{env}/mean")
        return "no samples" if mean is None else f"{mean:.3f}"

    per_env = " ".join(f"{e}={reward(e)}" for e in envs)
    return (
        f"step {step} | reward {reward('all')} ({per_env}) | trained {m['rollouts/all/trained']} "
        f"filtered {m['rollouts/all/filtered']} failed {m['rollouts/all/failed']} stale {m['rollouts/all/stale']} | "
        f"lag {m.get('off_policy_lag/all/mean', 0.0):.2f} | {m['time/step']:.1f}s (generate {m['time/generate']:.1f}s, "
        f"wait trainer {m['time/wait_trainer']:.1f}s, reload {m['time/reload']:.2f}s) | "
        f"{m['throughput/tokens_per_s']:.0f} tok/s{drift_part(m, envs)}{sandbox_part(m, envs)}{pool_part(m)}"
    )
