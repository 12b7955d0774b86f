"""`python -m prime_rl.runtime.start MODULE ARGS...`: runs `MODULE.main()` with `ARGS` as its command
line, MODULE imported with the collector paused and what it imported frozen (`imports.py`), for the
processes started by module name (vLLM's server): their own module's imports count too.

Invariant: MODULE sees the command line `python -m MODULE ARGS...` would give it (`sys.argv[1:]`).
"""

from __future__ import annotations

import importlib
import sys

from prime_rl.runtime.imports import heavy_imports


def main() -> None:
    module, sys.argv = sys.argv[1], [sys.argv[1], *sys.argv[2:]]
    with heavy_imports(freeze=True):  # this process's own start
        run = importlib.import_module(module).main
    run()


if __name__ == "__main__":
    main()
