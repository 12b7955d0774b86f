"""Online difficulty filtering: remember the examples a group always or never solved, and skip them.

Invariant: an example is skipped only after a group of it finished with a pass rate at or beyond a
threshold (`skip_above`, `skip_below`), judged by its most recent group. The memory holds only those
examples, never the dataset, and travels with the progress checkpoint, so a resumed run skips the
same examples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prime_rl.orchestrator.config import DifficultyFilterConfig


@dataclass
class DifficultyMemory:
    config: DifficultyFilterConfig
    extremes: dict[str, dict[str, float]] = field(default_factory=dict)
    """Env name -> example id (as a string) -> the pass rate of its last group, for skipped ones."""

    def pass_rate(self, rewards: list[float]) -> float:
        return sum(r >= self.config.pass_threshold for r in rewards) / len(rewards)

    def record(self, env: str, example_id: int | str, rewards: list[float]) -> None:
        """A finished group's rewards: remember the example if it is to be skipped, forget it if not."""
        if not self.config.enabled or not rewards:
            return
        rate, seen = self.pass_rate(rewards), self.extremes.setdefault(env, {})
        if rate >= self.config.skip_above or rate <= self.config.skip_below:
            seen[str(example_id)] = rate
        else:
            seen.pop(str(example_id), None)

    def skips(self, env: str, example_id: int | str) -> bool:
        return self.config.enabled and str(example_id) in self.extremes.get(env, {})

    def size(self, env: str) -> int:
        return len(self.extremes.get(env, {}))
