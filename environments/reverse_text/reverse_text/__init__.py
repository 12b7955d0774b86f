"""reverse-text: reverse a short string of lowercase letters.

Reward = similarity of the answer to the reversed string (longest-common-subsequence ratio), so a
partly right answer earns partial credit and a tiny model has a gradient to climb. The tasks are
generated from a seed: no download. `split = "eval"` gives the held-out strings.
"""

from __future__ import annotations

import random
import string
from typing import Literal

import verifiers.v1 as vf

SYSTEM_PROMPT = "Reverse the text character by character. Answer with the reversed text only."


def make_examples(n: int, seed: int, min_len: int, max_len: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        text = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(min_len, max_len)))
        rows.append({"question": text, "answer": text[::-1]})
    return rows


def lcs_ratio(a: str, b: str) -> float:
    """2 * LCS(a, b) / (len(a) + len(b)): 1.0 for equal strings, 0.0 when nothing matches."""
    if not a and not b:
        return 1.0
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return 2 * prev[-1] / (len(a) + len(b))


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def reversal_reward(self, trace: vf.Trace) -> float:
        return lcs_ratio(trace.last_reply, self.data.answer)


class ReverseConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    """'eval' gives the held-out strings (their own seed)."""
    num_examples: int = 2000
    seed: int = 0
    min_len: int = 3
    max_len: int = 8
    system: bool = True
    """Whether the tasks carry the system prompt (without: the string alone)."""


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self):
        c = self.config
        seed = c.seed if c.split == "train" else c.seed + 1
        for row in make_examples(c.num_examples, seed, c.min_len, c.max_len):
            data = ReverseData(
                prompt=row["question"],
                system_prompt=SYSTEM_PROMPT if c.system else None,
                answer=row["answer"],
            )
            yield ReverseTask(data, c.task)


__all__ = ["ReverseTaskset"]
