"""A test env whose reward scores the whole group together: a task reward that takes `traces`."""

import verifiers.v1 as vf
from words import Config, tasks


class RelativeTask(vf.Task):
    @vf.reward
    async def relative_length(self, traces: list[vf.Trace]) -> list[float]:
        lengths = [len(t.last_reply) for t in traces]
        top = max(lengths) or 1
        return [n / top for n in lengths]


class RelativeConfig(Config):
    num_examples: int = 50


class RelativeTaskset(vf.Taskset[RelativeTask, RelativeConfig]):
    def load(self):
        n = self.config.num_examples
        return tasks(RelativeTask, self.config, [f"item {i} " + "x" * (i % 5) for i in range(n)])


__all__ = ["RelativeTaskset"]
