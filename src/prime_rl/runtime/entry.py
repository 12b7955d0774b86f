"""The console scripts of the run's three processes: `inference`, `orchestrator`, `trainer`.

Invariant: a process takes Ctrl-C and SIGTERM (`prime_rl.runtime.shutdown`) before it imports its `main`
module, whose imports (torch, vLLM, verifiers) take seconds: a signal then stops it with its one
line, as anywhere later, instead of a KeyboardInterrupt traceback from inside an import. This module
imports nothing heavy itself. (`rl` stops its children its own way, `prime_rl.launcher.supervisor`.)
"""

from __future__ import annotations

import importlib
import os

from prime_rl.runtime.imports import heavy_imports
from prime_rl.runtime.logging_setup import setup_logging
from prime_rl.runtime.shutdown import Stopped, exit_stopped, take_signals


def _run(process: str, module: str, announce: bool = True) -> None:
    setup_logging(process)  # the stop line names the process; `main` sets logging up again, fully
    take_signals(announce=announce)
    try:
        with heavy_imports(freeze=True):  # this process's own start
            main = importlib.import_module(module).main
    except Stopped:
        exit_stopped()
    main()


def inference() -> None:
    _run("inference", "prime_rl.inference.main")


def orchestrator() -> None:
    _run("orchestrator", "prime_rl.orchestrator.main")


def trainer() -> None:
    # Under torchrun only the first rank says the line (the run says it once), as in its main.
    _run("trainer", "prime_rl.trainer.main", announce=os.environ.get("RANK", "0") == "0")
