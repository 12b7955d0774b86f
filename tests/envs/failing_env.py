"""A broken test env: it loads and generates, but its reward function raises for every rollout, as an
env with a bug would. A run on it must stop with one line, not spin on failures."""

import verifiers as vf
from datasets import Dataset


def broken_reward(completion, **kwargs) -> float:
    raise ValueError("broken_reward has a bug")


def load_environment(num_examples: int = 100) -> vf.Environment:
    rows = [{"question": f"Reverse: {i}", "answer": str(i)[::-1]} for i in range(num_examples)]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[broken_reward]))
