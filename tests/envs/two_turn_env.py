"""A test env of two model turns: the env answers the first with "again" (for multi-turn request tests)."""

import verifiers as vf
from datasets import Dataset


class TwoTurnEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        return [{"role": "user", "content": "again"}]


def turns(completion, **kwargs) -> float:
    return float(sum(m["role"] == "assistant" for m in completion))


def load_environment(num_examples: int = 20) -> vf.Environment:
    rows = [{"question": f"word{i}", "answer": ""} for i in range(num_examples)]
    return TwoTurnEnv(dataset=Dataset.from_list(rows), rubric=vf.Rubric(funcs=[turns]), max_turns=2)
