"""A single-turn test env whose reward is slow, raises or hangs, chosen by `mode`: for the tests that
reward functions run off the event loop, bounded and timed. Its reward is a plain `def` (verifiers'
own scoring would refuse it; the orchestrator runs it in a thread). The tests run it in their own
process and read what it records here, rather than timing it."""

import threading
import time
from typing import Literal

import verifiers.v1 as vf
from words import Config, tasks

LOOP_TURNS = [0]
"""Turns of the test's event loop, counted by the test: a burning reward reads it as it starts and ends."""
BURNS: list[tuple[str, int]] = []
"""Per burning reward: its thread's name, and how often the loop turned while it burned."""
HUNG: list[str] = []
"""The hung rewards that returned (each once `RELEASE` was set or `seconds` passed)."""
RELEASE = threading.Event()


def burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:  # CPU, holding the GIL between switches, like real Python code
        pass


class SlowConfig(Config):
    mode: Literal["burn", "raise", "hang"] = "burn"
    seconds: float = 0.05


class SlowData(vf.TaskData):
    mode: str
    seconds: float


class SlowTask(vf.Task[SlowData]):
    @vf.reward
    def slow_reward(self, trace: vf.Trace) -> float:
        if self.data.mode == "raise":
            raise ValueError("judge said no")
        if self.data.mode == "hang":
            RELEASE.wait(self.data.seconds)
            HUNG.append(threading.current_thread().name)
        else:
            turns = LOOP_TURNS[0]
            burn(self.data.seconds)
            BURNS.append((threading.current_thread().name, LOOP_TURNS[0] - turns))
        return 1.0


class SlowTaskset(vf.Taskset[SlowTask, SlowConfig]):
    def load(self):
        c = self.config
        prompts = [f"word{i}" for i in range(c.num_examples)]
        return tasks(SlowTask, c, prompts, mode=c.mode, seconds=c.seconds)


__all__ = ["SlowTaskset"]
