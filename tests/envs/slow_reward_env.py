"""A single-turn test env whose reward is slow, raises or hangs, chosen by `load_environment(mode=...)`:
for the tests that reward functions run off the event loop, bounded and timed."""

import time

import verifiers as vf
from datasets import Dataset


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:  # CPU, holding the GIL between switches, like real Python code
        pass


def load_environment(mode: str = "burn", seconds: float = 0.05, num_examples: int = 20) -> vf.Environment:
    def slow_reward(completion, answer, **kwargs) -> float:
        if mode == "raise":
            raise ValueError("judge said no")
        if mode == "hang":
            time.sleep(seconds)
        else:
            burn(seconds)
        return 1.0

    rows = [{"question": f"word{i}", "answer": f"{i}"} for i in range(num_examples)]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[slow_reward]))
