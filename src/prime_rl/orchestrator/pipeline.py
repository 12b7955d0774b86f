"""From a step's finished groups to its training batch: the one path, in pure steps.

    finished group ─ score_group ─▶ ScoredGroup (advantages, filters) ─ apply_batch_hooks ─▶
    ─ samples ─▶ TrainingBatch, with the step's counts beside it (build_step)

Every step returns new values and changes none of its inputs; the orchestrator runs `build_step`
in a worker thread, once per step, so user code (advantage functions) never runs on the event loop.

Invariants: every rollout of the input groups is in the result exactly once, counted as trained or
filtered for its env; an advantage that reaches a sample was validated (`advantage.py`); a filtered
rollout gets no sample; the batch hooks see only the rollouts that train.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from prime_rl.orchestrator.advantage import Advantage, AdvantageInputs
from prime_rl.orchestrator.rollout import Rollout
from prime_rl.orchestrator.samples import rollout_to_samples, sample_lengths
from prime_rl.transport.messages import Header, TrainingBatch, TrainingSample

ZERO_ADVANTAGE = 1e-8
"""Advantages below this are float noise: a group whose every advantage is below it teaches nothing."""


@dataclass(frozen=True)
class FinishedGroup:
    """The surviving (not failed) rollouts of one group, as the scheduler hands them over."""

    env_name: str
    example_id: int | str
    rollouts: tuple[Rollout, ...]


@dataclass(frozen=True)
class ScoredGroup:
    """A group with one advantage per rollout and the indices that filters keep out of training."""

    env_name: str
    example_id: int | str
    rollouts: tuple[Rollout, ...]
    advantages: tuple[float, ...]
    filtered: frozenset[int]

    def trained(self) -> list[tuple[Rollout, float]]:
        return [(r, a) for i, (r, a) in enumerate(zip(self.rollouts, self.advantages, strict=True))
                if i not in self.filtered]  # fmt: skip


@dataclass(frozen=True)
class PipelineConfig:
    seq_len: int
    """A rollout with a longer sample cannot be packed: always filtered."""
    min_group_size: int
    """Smaller groups are filtered whole, with advantage 0."""
    filters: tuple[tuple[str, bool], ...] = ()
    """(filter type, monitor only) in order: "zero_advantage" and "truncated"."""


def score_group(
    group: FinishedGroup, advantage: Advantage, config: PipelineConfig
) -> tuple[ScoredGroup, Counter]:
    """Advantages and filters of one group, and the filter counts ('<filter>/<env>', monitor-only
    filters included)."""
    env, rollouts = group.env_name, group.rollouts
    counts: Counter = Counter()
    if len(rollouts) < config.min_group_size:
        counts[f"min_group_size/{env}"] += len(rollouts)
        all_out = frozenset(range(len(rollouts)))
        return ScoredGroup(env, group.example_id, rollouts, (0.0,) * len(rollouts), all_out), counts
    out = advantage(AdvantageInputs(list(rollouts), env, group.example_id))
    advantages = tuple(out.advantages)
    drop = {i for i, r in enumerate(rollouts) if max(sample_lengths(r)) > config.seq_len}
    counts[f"overlong/{env}"] += len(drop)
    for kind, monitor_only in config.filters:
        if kind == "zero_advantage":
            hit = set(range(len(rollouts))) if all(abs(a) < ZERO_ADVANTAGE for a in advantages) else set()
        else:  # truncated
            hit = {i for i, r in enumerate(rollouts) if r.is_truncated}
        counts[f"{kind}/{env}"] += len(hit)
        if not monitor_only:
            drop |= hit
    return ScoredGroup(env, group.example_id, rollouts, advantages, frozenset(drop)), counts


def apply_batch_hooks(groups: list[ScoredGroup], advantages: dict[str, Advantage]) -> list[ScoredGroup]:
    """Each advantage function's batch hook over the advantages it gave the step's trained rollouts,
    across envs: envs configured with the same function (by name) share one hook call."""
    by_fn: dict[str, list[tuple[int, int]]] = {}  # function name -> (group index, rollout index)
    owners: dict[str, Advantage] = {}
    for gi, g in enumerate(groups):
        fn = advantages[g.env_name]
        if fn.batch_hook is not None:
            owners.setdefault(fn.name, fn)
            by_fn.setdefault(fn.name, []).extend(
                (gi, ri) for ri in range(len(g.rollouts)) if ri not in g.filtered
            )
    if not by_fn:
        return groups
    new = [list(g.advantages) for g in groups]
    for key, where in by_fn.items():
        values = owners[key].batch_hook([groups[gi].advantages[ri] for gi, ri in where])
        for (gi, ri), a in zip(where, values, strict=True):
            new[gi][ri] = a
    return [replace(g, advantages=tuple(a)) for g, a in zip(groups, new, strict=True)]


@dataclass(frozen=True)
class StepBuild:
    """A step's batch with what it cost to make it."""

    batch: TrainingBatch
    groups: list[ScoredGroup]
    counts: dict[str, Counter]
    """Rollouts per env in the buckets "trained" and "filtered"."""
    filter_counts: Counter
    """Rollouts each filter hit, per '<filter>/<env>' (monitor-only filters included)."""


def build_step(
    finished: list[FinishedGroup],
    advantages: dict[str, Advantage],
    temperatures: dict[str, float],
    config: PipelineConfig,
    run_id: str,
    step: int,
) -> StepBuild:
    filter_counts: Counter = Counter()
    scored = []
    for g in finished:
        s, counts = score_group(g, advantages[g.env_name], config)
        scored.append(s)
        filter_counts.update(counts)  # keeps zero counts: a filter that hit nothing logs 0
    scored = apply_batch_hooks(scored, advantages)
    samples: list[TrainingSample] = []
    buckets = {"trained": Counter(), "filtered": Counter()}
    for g in scored:
        trained = g.trained()
        buckets["trained"][g.env_name] += len(trained)
        buckets["filtered"][g.env_name] += len(g.filtered)
        for r, a in trained:
            samples.extend(rollout_to_samples(r, a, temperatures[g.env_name]))
    return StepBuild(TrainingBatch(Header(run_id, step), samples), scored, buckets, filter_counts)
