"""digit-sum-feedback-v1: the digit-sum-feedback game (give a number's digit sum as
`<answer>N</answer>`; after a wrong answer hear "Too low." or "Too high." and try again, up to three
tries), written against verifiers' v1 API: a `Taskset` of `Task`s scored by `@vf.reward` methods,
and an `Env` whose `run` plays the game turn by turn through the agent's interaction.

Same data, prompts, feedback and reward as the classic env (reward 1, 0.5 or 0.25 for the first
right answer at try 1, 2 or 3), so the classic env's tiny model plays it unchanged. `split =
"eval"` gives the held-out numbers.
"""

from __future__ import annotations

from typing import Literal

import verifiers.v1 as vf
from digit_sum_feedback import SYSTEM_PROMPT, feedback, make_examples, parse_answer

TURN_REWARDS = (1.0, 0.5, 0.25)


class GameData(vf.TaskData):
    answer: int


class GameTask(vf.Task[GameData]):
    @vf.reward(weight=1.0)
    async def feedback_reward(self, trace: vf.Trace) -> float:
        """`TURN_REWARDS[k]` for the first right answer at try k (the env records it), else 0."""
        k = trace.info.get("solved_at")
        return TURN_REWARDS[k] if k is not None and k < len(TURN_REWARDS) else 0.0

    @vf.metric
    async def first_turn_correct(self, trace: vf.Trace) -> float:
        return float(trace.info.get("solved_at") == 0)

    @vf.metric
    async def solved(self, trace: vf.Trace) -> float:
        return float(trace.info.get("solved_at") is not None)


class GameConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    num_examples: int = 5000
    seed: int = 0
    min_digits: int = 2
    max_digits: int = 3


class GameTaskset(vf.Taskset[GameTask, GameConfig]):
    def load(self):
        c = self.config
        seed = c.seed if c.split == "train" else c.seed + 1  # the classic env's train and eval seeds
        for i, row in enumerate(make_examples(c.num_examples, seed, c.min_digits, c.max_digits)):
            data = GameData(
                idx=i, prompt=row["question"], system_prompt=SYSTEM_PROMPT, answer=int(row["answer"])
            )
            yield GameTask(data, c.task)


class GameEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(max_turns=3)
    """The model: at most three answers."""


class GameEnv(vf.Env[GameEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as game:
            reply, tries = await game.turn(), 0
            while not reply.terminated:
                said = feedback(parse_answer(reply.last_reply), task.data.answer)
                if said is None:
                    game.trace.info["solved_at"] = tries
                    break
                tries += 1
                reply = await game.turn(said)


__all__ = ["GameEnv", "GameTaskset"]
