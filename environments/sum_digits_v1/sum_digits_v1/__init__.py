"""sum-digits-v1: the sum-digits task (give a number's digit sum as `<answer>N</answer>`), written
against verifiers' v1 API: a `Taskset` of `Task`s whose `@vf.reward` and `@vf.metric` methods
score a trace. Same data, prompt and reward as the classic `sum-digits`, so the same tiny model
plays it. `split = "eval"` gives the held-out set.
"""

from __future__ import annotations

import random
import re
from typing import Literal

import verifiers.v1 as vf

SYSTEM_PROMPT = "Add up the digits of the number. Reply as <answer>N</answer>."
ANSWER = re.compile(r"<answer>(\d+)</answer>")


def make_examples(n: int, seed: int, min_digits: int, max_digits: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = rng.randint(min_digits, max_digits)
        number = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        rows.append((number, str(sum(int(d) for d in number))))
    return rows


class SumDigitsData(vf.TaskData):
    answer: str


class SumDigitsTask(vf.Task[SumDigitsData]):
    @vf.reward(weight=1.0)
    async def correct_answer(self, trace: vf.Trace) -> float:
        """1.0 when the first `<answer>N</answer>` of the reply holds the digit sum."""
        found = ANSWER.search(trace.last_reply or "")
        return float(found is not None and found.group(1) == self.data.answer)

    @vf.metric
    async def answer_format(self, trace: vf.Trace) -> float:
        """1.0 when the whole reply is one `<answer>N</answer>`."""
        return float(ANSWER.fullmatch((trace.last_reply or "").strip()) is not None)


class SumDigitsConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    num_examples: int = 5000
    seed: int = 0
    min_digits: int = 2
    max_digits: int = 3


class SumDigitsTaskset(vf.Taskset[SumDigitsTask, SumDigitsConfig]):
    def load(self):
        c = self.config
        if not 1 <= c.min_digits <= c.max_digits:
            raise ValueError(
                f"sum-digits-v1: need 1 <= min_digits <= max_digits, got {c.min_digits} and {c.max_digits}"
            )
        # The classic env's seeds: the train set is `seed`, the eval set `seed + 1`.
        seed = c.seed if c.split == "train" else c.seed + 1
        for i, (number, answer) in enumerate(make_examples(c.num_examples, seed, c.min_digits, c.max_digits)):
            data = SumDigitsData(idx=i, prompt=number, system_prompt=SYSTEM_PROMPT, answer=answer)
            yield SumDigitsTask(data, c.task)


__all__ = ["SumDigitsTaskset"]
