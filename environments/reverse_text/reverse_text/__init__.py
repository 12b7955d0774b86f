"""reverse-text: reverse a short string of lowercase letters.

Reward = similarity of the answer to the reversed string (longest-common-subsequence ratio), so a
partly right answer earns partial credit and a tiny model has a gradient to climb. The dataset is
generated from a seed: no download.
"""

from __future__ import annotations

import random
import string

import verifiers as vf
from datasets import Dataset

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


def reversal_reward(completion, answer, **kwargs) -> float:
    text = completion
    if isinstance(completion, list):  # a failed rollout is still scored by verifiers, with no messages
        text = completion[-1]["content"] if completion else ""
    return lcs_ratio((text or "").strip(), answer)


def load_environment(
    num_train: int = 2000,
    num_eval: int = 100,
    seed: int = 0,
    min_len: int = 3,
    max_len: int = 8,
    system_prompt: str | None = SYSTEM_PROMPT,
) -> vf.Environment:
    train = Dataset.from_list(make_examples(num_train, seed, min_len, max_len))
    evals = Dataset.from_list(make_examples(num_eval, seed + 1, min_len, max_len))
    rubric = vf.Rubric(funcs=[reversal_reward], weights=[1.0])
    return vf.SingleTurnEnv(dataset=train, eval_dataset=evals, system_prompt=system_prompt, rubric=rubric)
