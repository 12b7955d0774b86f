"""sum-digits: give the sum of a number's digits as `<answer>N</answer>`.

Reward = exact match of N with the digit sum (1.0 or 0.0). A metric reports whether the reply has
exactly the answer format, so a run shows format and correctness apart. The tasks are generated
from a seed: no download; `split = "eval"` gives the held-out numbers.
"""

from __future__ import annotations

import random
import re
from typing import Literal

import verifiers.v1 as vf
from pydantic import model_validator

SYSTEM_PROMPT = "Add up the digits of the number. Reply as <answer>N</answer>."
ANSWER = re.compile(r"<answer>(\d+)</answer>")


def make_examples(n: int, seed: int, min_digits: int, max_digits: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digits = rng.randint(min_digits, max_digits)
        number = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        rows.append({"question": number, "answer": str(sum(int(d) for d in number))})
    return rows


def correct(reply: str, answer: str) -> float:
    """1.0 when the first `<answer>N</answer>` holds the digit sum."""
    found = ANSWER.search(reply)
    return float(found is not None and found.group(1) == answer)


def well_formed(reply: str) -> float:
    """1.0 when the whole reply is one `<answer>N</answer>`, nothing else."""
    return float(ANSWER.fullmatch(reply) is not None)


def preference_pairs(num_pairs: int, seed: int, min_digits: int = 2, max_digits: int = 3) -> list[dict]:
    """Preference pairs for training a reward model (`train-reward-model`): the right answer over a
    wrong one. Most rejected replies are a near-miss sum (the mistakes a small model makes); the
    rest hold the right sum in a broken format, which the env's reward also scores 0."""
    rng = random.Random(f"pairs-{seed}")
    pairs = []
    for row in make_examples(num_pairs, seed + 1000, min_digits, max_digits):
        total = int(row["answer"])
        if rng.random() < 0.8:
            wrong = rng.choice([t for t in range(max(0, total - 4), total + 5) if t != total])
            rejected = f"<answer>{wrong}</answer>"
        else:
            rejected = rng.choice([str(total), f"<answer>{total}", f"answer>{total}</answer>"])
        prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}]
        pairs.append({"prompt": prompt, "chosen": f"<answer>{total}</answer>", "rejected": rejected})
    return pairs


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct_answer(self, trace: vf.Trace) -> float:
        return correct(trace.last_reply, self.data.answer)

    @vf.metric
    async def answer_format(self, trace: vf.Trace) -> float:
        return well_formed(trace.last_reply)


class SumConfig(vf.TasksetConfig):
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


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        c = self.config
        seed = c.seed if c.split == "train" else c.seed + 1
        for row in make_examples(c.num_examples, seed, c.min_digits, c.max_digits):
            yield SumTask(
                SumData(prompt=row["question"], system_prompt=SYSTEM_PROMPT, answer=row["answer"]), c.task
            )


__all__ = ["SumTaskset"]
