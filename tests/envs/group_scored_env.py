"""A test env whose rubric scores the whole group together (a plural-parameter reward function)."""

import verifiers as vf
from datasets import Dataset


def relative_length(completions, **kwargs) -> list[float]:
    lengths = [len(c[-1]["content"]) for c in completions]
    top = max(lengths) or 1
    return [n / top for n in lengths]


def load_environment(num_examples: int = 50) -> vf.Environment:
    rows = [{"question": f"item {i} " + "x" * (i % 5), "answer": ""} for i in range(num_examples)]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[relative_length]))
