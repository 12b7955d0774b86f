"""The difficulty filter's memory: which examples it remembers, and which it forgets again."""

import pytest

from prime_rl.orchestrator.config import DifficultyFilterConfig
from prime_rl.orchestrator.loop.difficulty import DifficultyMemory


def test_it_remembers_the_extremes_only_and_forgets_an_example_that_moved():
    memory = DifficultyMemory(
        DifficultyFilterConfig(enabled=True, pass_threshold=0.5, skip_above=0.75, skip_below=0.25)
    )
    memory.record("e", 1, [1.0, 1.0, 0.6, 0.2])  # 3 of 4 pass: too easy
    memory.record("e", 2, [0.0, 0.1, 0.4, 0.0])  # none passes: too hard
    memory.record("e", 3, [1.0, 0.0, 1.0, 0.0])  # half: kept in training
    assert memory.skips("e", 1) and memory.skips("e", "2") and not memory.skips("e", 3)
    assert memory.extremes == {"e": {"1": 0.75, "2": 0.0}} and not memory.skips("other", 1)
    memory.record("e", 1, [1.0, 0.0, 0.0, 1.0])  # (drawn again anyway, e.g. after an epoch of skips)
    assert not memory.skips("e", 1) and memory.size("e") == 1


def test_disabled_it_remembers_nothing():
    memory = DifficultyMemory(DifficultyFilterConfig())
    memory.record("e", 1, [1.0, 1.0])
    assert not memory.skips("e", 1) and memory.extremes == {}


def test_thresholds_must_leave_a_band():
    with pytest.raises(ValueError, match=r"skip_below = 0\.5 must be below skip_above = 0\.5"):
        DifficultyFilterConfig(skip_below=0.5, skip_above=0.5)
