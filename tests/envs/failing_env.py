"""A broken test env: it loads and generates, but its reward raises for every rollout, as an env
with a bug would. A run on it must stop with one line, not spin on failures."""

import verifiers.v1 as vf
from words import Config, tasks


class BrokenTask(vf.Task):
    @vf.reward
    async def broken_reward(self, trace: vf.Trace) -> float:
        raise ValueError("broken_reward has a bug")


class BrokenConfig(Config):
    num_examples: int = 100


class BrokenTaskset(vf.Taskset[BrokenTask, BrokenConfig]):
    def load(self):
        return tasks(BrokenTask, self.config, [f"Reverse: {i}" for i in range(self.config.num_examples)])


__all__ = ["BrokenTaskset"]
