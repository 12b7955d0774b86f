"""digit-sum-feedback: a multi-turn game. The model gives a number's digit sum as `<answer>N</answer>`;
after a wrong answer the env says "Too low." or "Too high." (or restates the format), and the model
tries again, up to three answers.

A verifiers v1 taskset of `GameTask`s and a `GameEnv` whose `run` plays the game turn by turn through
the player's interaction. Reward = 1, 0.5 or 0.25 for the first right answer at try 1, 2 or 3, 0 if
none is right: it depends on every turn, and rewards getting it right early. Metrics report the
first answer's correctness and whether any answer was right. The numbers are generated from a seed
(no download); `split = "eval"` gives the held-out ones.
"""

from __future__ import annotations

import random
import re
from typing import Literal

import verifiers.v1 as vf
from pydantic import model_validator

SYSTEM_PROMPT = (
    "Add up the digits of the number. Reply as <answer>N</answer>. If told too low or too high, try again."
)
ANSWER = re.compile(r"<answer>(\d+)</answer>")
FORMAT_HINT = "Reply as <answer>N</answer>."
TURN_REWARDS = (1.0, 0.5, 0.25)


def make_examples(n: int, seed: int, min_digits: int, max_digits: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = rng.randint(min_digits, max_digits)
        number = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        rows.append({"question": number, "answer": str(sum(int(d) for d in number))})
    return rows


def parse_answer(text: str | None) -> int | None:
    found = ANSWER.search(text or "")
    return int(found.group(1)) if found else None


def feedback(guess: int | None, answer: int) -> str | None:
    """The env's reply to one answer: None when it is right."""
    if guess is None:
        return FORMAT_HINT
    if guess == answer:
        return None
    return "Too low." if guess < answer else "Too high."


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
    """'eval' gives the held-out numbers (their own seed)."""
    num_examples: int = 5000
    seed: int = 0
    min_digits: int = 2
    max_digits: int = 3

    @model_validator(mode="after")
    def _digits(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(
                f"need 1 <= min_digits <= max_digits, got {self.min_digits} and {self.max_digits}"
            )
        return self


class GameTaskset(vf.Taskset[GameTask, GameConfig]):
    def load(self):
        c = self.config
        seed = c.seed if c.split == "train" else c.seed + 1
        for row in make_examples(c.num_examples, seed, c.min_digits, c.max_digits):
            data = GameData(prompt=row["question"], system_prompt=SYSTEM_PROMPT, answer=int(row["answer"]))
            yield GameTask(data, c.task)


class GameEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig(max_turns=len(TURN_REWARDS))
    """The model: at most three answers."""


class GameEnv(vf.Env[GameEnvConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as game:
            reply = await game.turn()
            for tries in range(len(TURN_REWARDS)):
                if reply.terminated:
                    break
                said = feedback(parse_answer(reply.last_reply), task.data.answer)
                if said is None:
                    game.trace.info["solved_at"] = tries
                    break
                if tries + 1 < len(TURN_REWARDS):  # the game ends after the last try, answered or not
                    reply = await game.turn(said)


__all__ = ["GameEnv", "GameTaskset"]
