"""vLLM's engine core, in engine mode, keeps an activity record of its own, so that a hang of it is seen.

In engine mode the engine core is a forked child of the orchestrator (`forked.py`). Without a record
of its own, the orchestrator's "waiting for the inference" pointed `rl`'s watchdog at a process of
another machine, and a frozen engine core left the run waiting forever. With this record the engine
core is a process of kind "inference" here like a server: frozen (SIGSTOP, a C call holding the
GIL), it stops beating; stuck, its state and progress stand still while the orchestrator waits on it.
The watchdog then names it, takes its stack and kills it alone (`launcher/processes.py`), and the
orchestrator restarts its engine (`orchestrator/loop/health.py`).

Invariants: the record costs the engine's loop a comparison per iteration and one memory copy per
`PROGRESS_EVERY_S` while it generates (`activity`); idle, the engine core says it waits for the
orchestrator, so an idle engine is never the culprit of a stall elsewhere.
"""

from __future__ import annotations

import time
from pathlib import Path

from prime_rl.runtime import activity

PROGRESS_EVERY_S = 1.0

_installed: list[Path] = []


def keep_records(output_dir: Path | str) -> None:
    """Have the engine cores that this process starts from now on keep an activity record in the
    run's folder (`activity.folder(output_dir)`). A second call changes nothing."""
    if _installed:
        return
    from vllm.v1.engine.core import EngineCoreProc

    run = EngineCoreProc.run_engine_core

    def run_recorded(*args, **kwargs):
        activity.start(activity.ENGINE_CORE, "inference", output_dir, doing="starting vLLM's engine core")
        return run(*args, **kwargs)

    wait_for_work = EngineCoreProc._process_input_queue
    step = EngineCoreProc._process_engine_step
    steps = [0, 0.0]  # engine steps so far, and when the count was last written

    def wait_for_work_recorded(self):
        if not self.has_work():
            activity.doing("idle, waiting for requests", "orchestrator")
        return wait_for_work(self)

    def step_recorded(self):
        activity.doing("generating")
        steps[0] += 1
        now = time.monotonic()
        if now - steps[1] >= PROGRESS_EVERY_S:
            steps[1] = now
            activity.progress(steps[0])
        return step(self)

    EngineCoreProc.run_engine_core = staticmethod(run_recorded)
    EngineCoreProc._process_input_queue = wait_for_work_recorded
    EngineCoreProc._process_engine_step = step_recorded
    _installed.append(Path(output_dir))
