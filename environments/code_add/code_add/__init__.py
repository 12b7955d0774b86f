"""code-add: tool-add's sums, done by running model-written code. The model calls `python(code)`
with a program that prints the sum, reads what it printed, and answers `<answer>N</answer>`.

The tool runs the program in a fresh Python process (`python -I -S -c`, `TIMEOUT_S`), and prime_rl
runs the env's tools in its sandbox: the program reaches neither the network nor the run's files,
and a program that spins, forks or fills memory fails its call, not the run. Reward = 1.0 when the
final answer is the sum; a metric reports whether a program printed it. The numbers are tool-add's
(seeded, `split = "eval"` held out).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile

import verifiers.v1 as vf
from tool_add import ANSWER, AddConfig, AddData, AddEnv, make_examples

SYSTEM_PROMPT = "Add the numbers by running Python with the python tool. Reply as <answer>N</answer>."
TIMEOUT_S = 5.0
OUTPUT_CHARS = 2000


class PythonTools(vf.Toolset):
    TOOL_PREFIX = None  # the model calls `python`

    @vf.tool
    def python(self, code: str) -> str:
        """Run a Python program and return what it printed."""
        # Its output goes to a file, not a pipe: a file is bounded by the sandbox's `file_mb`, and
        # processes the program left running cannot hold the call open.
        with tempfile.TemporaryFile() as out:
            # -I -S: none of the caller's environment variables for Python, nor its site-packages.
            argv = [sys.executable, "-I", "-S", "-c", code]
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=TIMEOUT_S)
            if done.returncode < 0:  # a limit's signal: the CPU's (SIGXCPU), ...
                raise RuntimeError(f"killed by {signal.Signals(-done.returncode).name}")
            out.seek(max(0, out.tell() - OUTPUT_CHARS) if done.returncode else 0)
            printed = out.read(OUTPUT_CHARS).decode(errors="replace").strip()
        if done.returncode > 0:  # the error is the end of what it printed (a traceback's last line)
            last = printed.splitlines()[-1][-200:] if printed else ""
            raise RuntimeError(f"exit status {done.returncode}: {last}")
        return printed


class CodeTask(vf.Task[AddData]):
    @classmethod
    def toolsets(cls, config):
        return [PythonTools(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct_answer(self, trace: vf.Trace) -> float:
        """1.0 when the last reply's `<answer>N</answer>` is the sum."""
        found = ANSWER.search(trace.last_reply)
        return float(found is not None and found.group(1) == self.data.answer)

    @vf.metric
    async def printed_the_sum(self, trace: vf.Trace) -> float:
        """1.0 when a program the model ran printed the sum."""
        return float(any((m.content or "").strip() == self.data.answer for m in trace.tool_messages))


class CodeTaskset(vf.Taskset[CodeTask, AddConfig]):
    def load(self):
        c = self.config
        seed = c.seed if c.split == "train" else c.seed + 1
        for row in make_examples(c.num_examples, seed, c.digits):
            data = AddData(
                prompt=row["question"], system_prompt=SYSTEM_PROMPT, answer=row["answer"], **row["info"]
            )
            yield CodeTask(data, c.task)


class CodeEnv(AddEnv):
    """tool-add's game: at most three model calls (the program, the answer, one more try)."""


__all__ = ["CodeEnv", "CodeTaskset"]
