"""Rollouts to training samples: exact tokens, multi-turn merging with masked env tokens."""

from prime_rl.orchestrator.loop.samples import rollout_to_samples, sample_lengths
from prime_rl.orchestrator.rollout import Rollout, Turn


def rollout(*turns: Turn) -> Rollout:
    return Rollout("env", 1, policy_version=3, reward=0.5, turns=list(turns))


def test_single_turn():
    [s] = rollout_to_samples(rollout(Turn([1, 2], [3, 4], [1, 1], [-0.1, -0.2])), 0.2, temperature=0.7)
    assert (s.prompt_ids, s.completion_ids, s.completion_mask) == ([1, 2], [3, 4], [1, 1])
    assert (s.advantage, s.reward, s.policy_version, s.temperature) == (0.2, 0.5, 3, 0.7)


def test_extending_turns_merge_and_mask_inserted_tokens():
    r = rollout(
        Turn([1, 2], [3, 4], [1, 1], [-0.1, -0.2]),
        Turn([1, 2, 3, 4, 9, 9], [5], [1], [-0.3]),  # env inserted [9, 9]
    )
    [s] = rollout_to_samples(r, 0.2)
    assert s.prompt_ids == [1, 2]
    assert s.completion_ids == [3, 4, 9, 9, 5]
    assert s.completion_mask == [1, 1, 0, 0, 1]
    assert s.completion_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    assert sample_lengths(r) == [len(s)]


def test_non_extending_turn_starts_a_new_sample():
    r = rollout(Turn([1, 2], [3], [1], [-0.1]), Turn([7, 8], [9], [1], [-0.2]))
    samples = rollout_to_samples(r, 0.2)
    assert [s.prompt_ids for s in samples] == [[1, 2], [7, 8]]
    assert sample_lengths(r) == [3, 3]


def test_turn_stats_count_turns_samples_and_env_tokens():
    from prime_rl.orchestrator.loop.samples import turn_stats

    merged = rollout(
        Turn([1, 2], [3, 4], [1, 1], [-0.1, -0.2]),
        Turn([1, 2, 3, 4, 9, 9], [5], [1], [-0.3]),  # env inserted [9, 9]
        Turn([1, 2, 3, 4, 9, 9, 5, 8], [6, 6], [1, 1], [-0.1, -0.1]),  # and [8]
    )
    s = turn_stats(merged)
    assert (s.turns, s.samples, s.model_tokens, s.env_tokens) == (3, 1, 5, 3)
    split = rollout(Turn([1, 2], [3], [1], [-0.1]), Turn([7, 8, 7, 8], [9], [1], [-0.2]))
    assert turn_stats(split).samples == 2 and turn_stats(split).env_tokens == 1
