"""The pipeline from finished groups to a step's batch: advantages, filters, batch hooks, samples."""

from prime_rl.orchestrator.advantages import build_advantage
from prime_rl.orchestrator.advantages.grpo import GRPOAdvantage
from prime_rl.orchestrator.loop.pipeline import FinishedGroup, PipelineConfig, build_step, score_group
from prime_rl.orchestrator.rollout import Rollout, Turn

GRPO = build_advantage(GRPOAdvantage())
CONFIG = PipelineConfig(seq_len=64, min_group_size=2, filters=(("zero_advantage", False),))


def rollout(reward: float, completion: int = 2, truncated: bool = False, env: str = "e") -> Rollout:
    turn = Turn([1, 2, 3], [4] * completion, [1] * completion, [-0.5] * completion)
    return Rollout(env, 7, 0, reward=reward, turns=[turn], is_truncated=truncated)


def group(*rewards: float, env: str = "e", **kw) -> FinishedGroup:
    return FinishedGroup(env, 7, tuple(rollout(r, env=env, **kw) for r in rewards))


def test_a_group_gets_its_advantages_and_nothing_filtered():
    scored, counts = score_group(group(1.0, 0.0), GRPO, CONFIG)
    assert scored.advantages == (0.5, -0.5) and not scored.filtered
    assert counts == {"overlong/e": 0, "zero_advantage/e": 0}


def test_a_group_that_teaches_nothing_is_filtered_or_only_counted():
    scored, counts = score_group(group(1.0, 1.0), GRPO, CONFIG)
    assert scored.filtered == {0, 1} and counts["zero_advantage/e"] == 2
    monitor = PipelineConfig(64, 2, (("zero_advantage", True),))
    scored, counts = score_group(group(1.0, 1.0), GRPO, monitor)
    assert not scored.filtered and counts["zero_advantage/e"] == 2


def test_too_small_and_overlong_and_truncated():
    scored, counts = score_group(group(1.0), GRPO, CONFIG)  # below min_group_size
    assert scored.filtered == {0} and scored.advantages == (0.0,) and counts["min_group_size/e"] == 1
    long = FinishedGroup("e", 7, (rollout(1.0, completion=70), rollout(0.0)))
    scored, counts = score_group(long, GRPO, CONFIG)
    assert scored.filtered == {0} and counts["overlong/e"] == 1
    truncating = PipelineConfig(64, 2, (("truncated", False),))
    scored, _ = score_group(
        FinishedGroup("e", 7, (rollout(1.0, truncated=True), rollout(0.0))), GRPO, truncating
    )
    assert scored.filtered == {0}


def test_build_step_counts_every_rollout_once_and_samples_only_the_trained():
    groups = [group(1.0, 0.0), group(1.0, 1.0), group(0.0, 0.5, 1.0, env="f")]
    built = build_step(groups, {"e": GRPO, "f": GRPO}, {"e": 1.0, "f": 0.7}, CONFIG, "run", 3)
    assert built.counts == {"trained": {"e": 2, "f": 3}, "filtered": {"e": 2, "f": 0}}
    assert built.batch.header.step == 3
    samples = built.batch.samples
    assert [(s.env_name, s.advantage) for s in samples] == [
        ("e", 0.5), ("e", -0.5), ("f", -0.5), ("f", 0.0), ("f", 0.5)
    ]  # fmt: skip
    assert {s.temperature for s in samples if s.env_name == "f"} == {0.7}
    assert built.filter_counts["zero_advantage/e"] == 2


def test_reward_clip_bounds_the_rewards_that_train_not_the_logged_ones():
    clipping = PipelineConfig(64, 2, (), reward_clip=1.0)
    built = build_step([group(5.0, 0.0, -3.0)], {"e": GRPO}, {"e": 1.0}, clipping, "run", 0)
    assert [s.reward for s in built.batch.samples] == [1.0, 0.0, -1.0]
    assert [s.advantage for s in built.batch.samples] == [1.0, 0.0, -1.0]  # mean of (1, 0, -1) is 0
    assert [r.reward for r in built.groups[0].rollouts] == [5.0, 0.0, -3.0]
