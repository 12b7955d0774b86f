"""A verifiers.v1 test env: tasks whose prompt is a word; the reward is 1.0 when the reply reverses it.
`mode = "raise"` makes the reward raise (for the failure tests); `endless = true` makes the
taskset a generator that never ends (it can only be streamed); `LOADED` counts the tasks built."""

import itertools
from typing import Literal

import verifiers.v1 as vf


class WordData(vf.TaskData):
    word: str
    mode: str = "ok"


class WordTask(vf.Task[WordData]):
    @vf.reward(weight=1.0)
    async def reversed_word(self, trace: vf.Trace) -> float:
        if self.data.mode == "raise":
            raise ValueError("judge said no")
        return float((trace.last_reply or "").strip() == self.data.word[::-1])

    @vf.metric
    async def reply_length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or ""))


class WordConfig(vf.TasksetConfig):
    num_examples: int = 6
    mode: Literal["ok", "raise"] = "ok"
    endless: bool = False


LOADED = [0]


class WordTaskset(vf.Taskset[WordTask, WordConfig]):
    def load(self):
        c = self.config
        for i in itertools.count() if c.endless else range(c.num_examples):
            LOADED[0] += 1
            data = WordData(idx=i, prompt=f"word{i}", word=f"word{i}", mode=self.config.mode)
            yield WordTask(data, self.config.task)


__all__ = ["WordTaskset"]
