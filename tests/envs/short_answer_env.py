"""An easy test env: the shorter the answer, the higher the reward. A tiny model learns it in a few
RL steps (by ending its turn sooner), which makes it a quick check that training moves the policy."""

import verifiers as vf
from datasets import Dataset


def brevity(completion, **kwargs) -> float:
    text = completion[-1]["content"] if completion else ""
    return max(0.0, 1.0 - len(text or "") / 40)


def load_environment(num_examples: int = 200) -> vf.Environment:
    rows = [{"question": f"Say something about {i}.", "answer": ""} for i in range(num_examples)]
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[brevity]))
