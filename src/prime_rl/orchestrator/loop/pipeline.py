"""From a step's finished groups to its training batch: the one path, in pure steps.

    finished group ─ score_group ─▶ ScoredGroup (advantages, filters) ─ samples ─▶ TrainingBatch,
    with the step's counts beside it (build_step)

Every step returns new values and changes none of its inputs; the orchestrator runs `build_step`
in a worker thread, once per step, so user code (advantage functions) never runs on the event loop.

Invariants: every rollout of the input groups is in the result exactly once, counted as trained or
filtered for its env; an advantage that reaches a sample was validated (one finite float per rollout,
by `Advantage` in `orchestrator/advantages/base.py`); a filtered rollout gets no sample.
Normalization over the batch is not done here: it happens once, in the trainer
(`trainer.advantage.batch_normalize`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace

from prime_rl.orchestrator.advantages import Advantage, AdvantageInputs
from prime_rl.orchestrator.loop.samples import rollout_to_samples, sample_lengths
from prime_rl.orchestrator.rollout import Rollout
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
    rewards: tuple[float, ...] | None = None
    """The rewards that train (after `reward_clip`); None: the rollouts' own."""

    def trained(self) -> list[tuple[Rollout, float]]:
        return [
            (r, a)
            for i, (r, a) in enumerate(zip(self.rollouts, self.advantages, strict=True))
            if i not in self.filtered
        ]

    def trained_rewards(self) -> list[float]:
        rewards = self.rewards if self.rewards is not None else tuple(r.reward for r in self.rollouts)
        return [x for i, x in enumerate(rewards) if i not in self.filtered]


@dataclass(frozen=True)
class PipelineConfig:
    seq_len: int
    """A rollout with a longer sample cannot be packed: always filtered."""
    min_group_size: int
    """Smaller groups are filtered whole, with advantage 0."""
    filters: tuple[tuple[str, bool], ...] = ()
    """(filter type, monitor only) in order: "zero_advantage" and "truncated"."""
    reward_clip: float | None = None
    """Rewards are bounded to [-c, c] for advantages and training (not in the logged records)."""
    advantage_weight: float = 1.0
    """Factor on every trained rollout's advantage (a teacher's `advantage_weight`)."""
    distill_weight: float = 0.0
    """Factor on the per-token teacher term (0: no distillation)."""
    route_experts: int = 0
    """Experts per layer of a MoE policy whose routes every sample must carry (the orchestrator's
    `return_routes`); 0: samples carry none."""


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
    scored = rollouts
    if config.reward_clip is not None:
        c = config.reward_clip
        scored = tuple(replace(r, reward=min(max(r.reward, -c), c)) for r in rollouts)
    out = advantage(AdvantageInputs(list(scored), env, group.example_id))
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
    rewards = tuple(r.reward for r in scored)
    return ScoredGroup(env, group.example_id, rollouts, advantages, frozenset(drop), rewards), counts


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
    samples: list[TrainingSample] = []
    buckets = {"trained": Counter(), "filtered": Counter()}
    for g in scored:
        trained = g.trained()
        buckets["trained"][g.env_name] += len(trained)
        buckets["filtered"][g.env_name] += len(g.filtered)
        for (r, a), reward in zip(trained, g.trained_rewards(), strict=True):
            samples.extend(
                rollout_to_samples(
                    r,
                    a * config.advantage_weight,
                    temperatures[g.env_name],
                    reward,
                    config.distill_weight,
                    config.route_experts,
                )
            )
    return StepBuild(TrainingBatch(Header(run_id, step), samples), scored, buckets, filter_counts)
