"""digit-sum-feedback: a multi-turn game. The model gives a number's digit sum as `<answer>N</answer>`;
after a wrong answer the env says "Too low." or "Too high." (or restates the format), and the model
tries again, up to `max_turns` answers.

Reward = `turn_rewards[k]` for the first correct answer at turn k (1.0, 0.5, 0.25 by default), 0 if
none is right: it depends on every turn, and rewards getting it right early. Zero-weight metrics
report the first answer's correctness and whether any answer was right. Data is generated from a
seed: no download.
"""

from __future__ import annotations

import random
import re

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = (
    "Add up the digits of the number. Reply as <answer>N</answer>. If told too low or too high, try again."
)
ANSWER = re.compile(r"<answer>(\d+)</answer>")
FORMAT_HINT = "Reply as <answer>N</answer>."


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


def assistant_texts(completion) -> list[str]:
    if not isinstance(completion, list):  # a failed rollout is still scored by verifiers, with no messages
        return [completion or ""]
    return [m["content"] or "" for m in completion if m["role"] == "assistant"]


def first_correct_turn(completion, answer: str) -> int | None:
    for k, text in enumerate(assistant_texts(completion)):
        if parse_answer(text) == int(answer):
            return k
    return None


class DigitSumFeedbackEnv(vf.MultiTurnEnv):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    @vf.stop
    async def solved(self, state) -> bool:
        trajectory = state["trajectory"]
        if not trajectory:
            return False
        last = trajectory[-1]["completion"]
        return bool(last) and parse_answer(last[-1]["content"]) == int(state["answer"])

    async def env_response(self, messages, state, **kwargs):
        reply = feedback(parse_answer(messages[-1]["content"]), int(state["answer"]))
        return [vf.UserMessage(content=reply or "Correct.")]


def make_reward(turn_rewards: list[float]):
    def feedback_reward(completion, answer, **kwargs) -> float:
        """`turn_rewards[k]` for the first correct answer at turn k, else 0."""
        k = first_correct_turn(completion, answer)
        return turn_rewards[k] if k is not None and k < len(turn_rewards) else 0.0

    return feedback_reward


def first_turn_correct(completion, answer, **kwargs) -> float:
    return float(first_correct_turn(completion, answer) == 0)


def solved(completion, answer, **kwargs) -> float:
    return float(first_correct_turn(completion, answer) is not None)


def load_environment(
    num_train: int = 5000,
    num_eval: int = 200,
    seed: int = 0,
    min_digits: int = 2,
    max_digits: int = 3,
    max_turns: int = 3,
    turn_rewards: list[float] | None = None,
    system_prompt: str | None = SYSTEM_PROMPT,
) -> vf.Environment:
    if not 1 <= min_digits <= max_digits:
        raise ValueError(
            f"digit-sum-feedback: need 1 <= min_digits <= max_digits, got {min_digits} and {max_digits}"
        )
    if max_turns < 1:
        raise ValueError(f"digit-sum-feedback: max_turns must be >= 1, got {max_turns}")
    turn_rewards = turn_rewards or [1.0, 0.5, 0.25]
    train = Dataset.from_list(make_examples(num_train, seed, min_digits, max_digits))
    evals = Dataset.from_list(make_examples(num_eval, seed + 1, min_digits, max_digits))
    rubric = vf.Rubric(funcs=[make_reward(turn_rewards), first_turn_correct, solved], weights=[1.0, 0.0, 0.0])
    return DigitSumFeedbackEnv(
        dataset=train, eval_dataset=evals, system_prompt=system_prompt, rubric=rubric, max_turns=max_turns
    )
