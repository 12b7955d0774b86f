"""A test env of two model turns: the env answers the first with "again"."""

import verifiers.v1 as vf
from words import Config, tasks


class TurnsTask(vf.Task):
    @vf.reward
    async def turns(self, trace: vf.Trace) -> float:
        return float(trace.num_turns)


class TurnsTaskset(vf.Taskset[TurnsTask, Config]):
    def load(self):
        return tasks(TurnsTask, self.config, [f"word{i}" for i in range(self.config.num_examples)])


class TwoTurnConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(max_turns=2)


class TwoTurnEnv(vf.Env[TwoTurnConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            reply = await chat.turn()
            if not reply.terminated:
                await chat.turn("again")


__all__ = ["TurnsTaskset", "TwoTurnEnv"]
