"""tool-add: add two numbers of `digits` digits, a sum a tiny model cannot do in its head, with a
Python tool. The model calls `add(a, b)`, reads the result, and answers `<answer>N</answer>`.

Reward = 1.0 when the final answer is the sum, else 0 (a copying mistake in the call's arguments or
in the answer both cost it). Zero-weight metrics: whether the model called the tool with the right
numbers, and verifiers' own tool-call counts. Tool errors (bad arguments) come back to the model as
a tool message starting with "Error:". Data is generated from a seed: no download.
"""

from __future__ import annotations

import json
import random
import re

import verifiers as vf
from datasets import Dataset

SYSTEM_PROMPT = "Add the numbers with the add tool. Reply as <answer>N</answer>."
ANSWER = re.compile(r"<answer>(-?\d+)</answer>")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def make_examples(n: int, seed: int, digits: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = (rng.randint(10 ** (digits - 1), 10**digits - 1) for _ in range(2))
        rows.append({"question": f"{a} + {b}", "answer": str(a + b), "info": {"a": a, "b": b}})
    return rows


def final_text(completion) -> str:
    if not isinstance(completion, list):
        return completion or ""
    replies = [m for m in completion if m["role"] == "assistant"]
    return (replies[-1].get("content") or "") if replies else ""


def correct_answer(completion, answer, **kwargs) -> float:
    """1.0 when the last reply's `<answer>N</answer>` is the sum."""
    found = ANSWER.search(final_text(completion))
    return float(found is not None and found.group(1) == answer)


def called_with_the_numbers(completion, info, **kwargs) -> float:
    """1.0 when some `add` call carried exactly the question's two numbers."""
    for m in completion if isinstance(completion, list) else []:
        for call in m.get("tool_calls") or [] if m["role"] == "assistant" else []:
            function = call.get("function", call) if isinstance(call, dict) else call
            name = function.get("name") if isinstance(function, dict) else getattr(function, "name", None)
            args = (
                function.get("arguments")
                if isinstance(function, dict)
                else getattr(function, "arguments", None)
            )
            try:
                args = json.loads(args) if isinstance(args, str) else args
            except ValueError:
                continue
            if name == "add" and isinstance(args, dict) and args == {"a": info["a"], "b": info["b"]}:
                return 1.0
    return 0.0


def load_environment(
    num_train: int = 5000, num_eval: int = 200, seed: int = 0, digits: int = 4, max_turns: int = 3
) -> vf.Environment:
    if digits < 1:
        raise ValueError(f"tool-add: digits must be >= 1, got {digits}")
    train = Dataset.from_list(make_examples(num_train, seed, digits))
    evals = Dataset.from_list(make_examples(num_eval, seed + 1, digits))
    rubric = vf.Rubric(funcs=[correct_answer, called_with_the_numbers], weights=[1.0, 0.0])
    return vf.ToolEnv(
        tools=[add],
        max_turns=max_turns,
        error_formatter=lambda e: f"Error: {e}",
        dataset=train,
        eval_dataset=evals,
        system_prompt=SYSTEM_PROMPT,
        rubric=rubric,
    )
