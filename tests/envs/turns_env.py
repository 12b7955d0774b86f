"""A test env of `turns` model turns (default 2): the env answers each reply with "again"."""

import verifiers.v1 as vf
from words import Config, tasks


class TurnsTask(vf.Task):
    @vf.reward
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class TurnsConfig(Config):
    turns: int = 2


class TurnsTaskset(vf.Taskset[TurnsTask, TurnsConfig]):
    def load(self):
        return tasks(TurnsTask, self.config, [f"word{i}" for i in range(self.config.num_examples)])


class TurnsEnv(vf.Env[vf.SingleAgentEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            reply = await chat.turn()
            for _ in range(self.taskset.config.turns - 1):
                if reply.terminated:
                    break
                reply = await chat.turn("again")


__all__ = ["TurnsEnv", "TurnsTaskset"]
