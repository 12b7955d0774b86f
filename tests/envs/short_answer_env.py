"""An easy test env: the shorter the answer, the higher the reward. A tiny model learns it in a few
RL steps (by ending its turn sooner), which makes it a quick check that training moves the policy."""

import verifiers.v1 as vf
from words import Config, tasks


class BriefTask(vf.Task):
    @vf.reward
    def brevity(self, trace: vf.Trace) -> float:
        return max(0.0, 1.0 - len(trace.last_reply) / 40)


class BriefConfig(Config):
    num_examples: int = 200


class BriefTaskset(vf.Taskset[BriefTask, BriefConfig]):
    def load(self):
        return tasks(
            BriefTask, self.config, [f"Say something about {i}." for i in range(self.config.num_examples)]
        )


__all__ = ["BriefTaskset"]
