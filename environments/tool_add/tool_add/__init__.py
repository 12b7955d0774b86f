"""tool-add: add two numbers of `digits` digits, a sum a tiny model cannot do in its head, with a
Python tool. The model calls `add(a, b)`, reads the result, and answers `<answer>N</answer>`.

A verifiers v1 taskset whose tasks offer one toolset (`AddTools`, its tool advertised as plain
`add`), and an env whose one seat makes at most `MAX_TURNS` model calls. Reward = 1.0 when the
final answer is the sum, else 0 (a copying mistake in the call's arguments or in the answer both
cost it). A metric reports whether the model called the tool with the right numbers. A bad call
comes back to the model as a tool result starting with "Error:". The numbers are generated from a
seed: no download; `split = "eval"` gives the held-out ones.
"""

from __future__ import annotations

import json
import random
import re
from typing import Literal

import verifiers.v1 as vf
from pydantic import Field

SYSTEM_PROMPT = "Add the numbers with the add tool. Reply as <answer>N</answer>."
ANSWER = re.compile(r"<answer>(-?\d+)</answer>")
MAX_TURNS = 3


def make_examples(n: int, seed: int, digits: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = (rng.randint(10 ** (digits - 1), 10**digits - 1) for _ in range(2))
        rows.append({"question": f"{a} + {b}", "answer": str(a + b), "info": {"a": a, "b": b}})
    return rows


class AddTools(vf.Toolset):
    TOOL_PREFIX = None  # the model calls `add`, not `add_tools_add`

    @vf.tool
    def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


class AddData(vf.TaskData):
    answer: str
    a: int
    b: int


class AddTask(vf.Task[AddData]):
    @classmethod
    def toolsets(cls, config):
        return [AddTools(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct_answer(self, trace: vf.Trace) -> float:
        """1.0 when the last reply's `<answer>N</answer>` is the sum."""
        found = ANSWER.search(trace.last_reply)
        return float(found is not None and found.group(1) == self.data.answer)

    @vf.metric
    async def called_with_the_numbers(self, trace: vf.Trace) -> float:
        """1.0 when some `add` call carried exactly the question's two numbers."""
        for message in trace.assistant_messages:
            for call in message.tool_calls or []:
                try:
                    args = json.loads(call.arguments)
                except ValueError:
                    continue
                if call.name == "add" and args == {"a": self.data.a, "b": self.data.b}:
                    return 1.0
        return 0.0


class AddConfig(vf.TasksetConfig):
    split: Literal["train", "eval"] = "train"
    """'eval' gives the held-out sums (their own seed)."""
    num_examples: int = 5000
    seed: int = 0
    digits: int = Field(4, ge=1)


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        c = self.config
        seed = c.seed if c.split == "train" else c.seed + 1
        for row in make_examples(c.num_examples, seed, c.digits):
            data = AddData(
                prompt=row["question"], system_prompt=SYSTEM_PROMPT, answer=row["answer"], **row["info"]
            )
            yield AddTask(data, c.task)


class AddEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig(max_turns=MAX_TURNS)
    """The model: at most three calls (a tool call, the answer, one more try)."""


class AddEnv(vf.Env[AddEnvConfig]):
    async def run(self, task, agents):
        await agents.agent.run(task)


__all__ = ["AddEnv", "AddTaskset"]
