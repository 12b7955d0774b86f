"""sum-digits: give the sum of a number's digits as `<answer>N</answer>`.

Reward = exact match of N with the digit sum (1.0 or 0.0). A second, zero-weight function reports
whether the reply has exactly the answer format, so a run shows format and correctness apart. The
dataset is generated from a seed: no download.
"""

from __future__ import annotations

import random
import re

import verifiers as vf
from datasets import Dataset

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


def _reply(completion) -> str:
    text = completion
    if isinstance(completion, list):  # a failed rollout is still scored by verifiers, with no messages
        text = completion[-1]["content"] if completion else ""
    return (text or "").strip()


def correct_answer(completion, answer, **kwargs) -> float:
    """1.0 when the first `<answer>N</answer>` holds the digit sum."""
    found = ANSWER.search(_reply(completion))
    return float(found is not None and found.group(1) == answer)


def answer_format(completion, **kwargs) -> float:
    """1.0 when the whole reply is one `<answer>N</answer>`, nothing else."""
    return float(ANSWER.fullmatch(_reply(completion)) is not None)


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


def load_environment(
    num_train: int = 5000,
    num_eval: int = 200,
    seed: int = 0,
    min_digits: int = 2,
    max_digits: int = 3,
    system_prompt: str | None = SYSTEM_PROMPT,
) -> vf.Environment:
    if not 1 <= min_digits <= max_digits:
        raise ValueError(f"sum-digits: need 1 <= min_digits <= max_digits, got {min_digits} and {max_digits}")
    train = Dataset.from_list(make_examples(num_train, seed, min_digits, max_digits))
    evals = Dataset.from_list(make_examples(num_eval, seed + 1, min_digits, max_digits))
    rubric = vf.Rubric(funcs=[correct_answer, answer_format], weights=[1.0, 0.0])
    return vf.SingleTurnEnv(dataset=train, eval_dataset=evals, system_prompt=system_prompt, rubric=rubric)
