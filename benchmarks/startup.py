"""What a process's start costs in CPU, and what pausing the garbage collector over its imports saves
(`prime_rl/runtime/imports.py`).

    uv run python benchmarks/startup.py [--repeats 3]

For each process's heavy imports (vLLM's server, the orchestrator, the trainer, `verifiers.v1` as an
env worker or `rl`'s checks import it), three ways, each in a fresh interpreter, the CPU time
(user + system) of the import followed by one full collection (which a running process makes
sooner or later):

- `gc on`: Python's default, the collector running all along;
- `paused`: `heavy_imports(freeze=True)`, as our processes start;
- `floor`: the collector off and no collection at all, what the import alone costs: the limit.

Printed: the median of `--repeats` alternating runs, and paused / gc on, paused / floor.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

IMPORTS = {
    "vLLM server": "vllm.entrypoints.launchers.api_server.entry",
    "orchestrator": "prime_rl.orchestrator.main",
    "trainer": "prime_rl.trainer.main",
    "verifiers.v1": "verifiers.v1",
}

CHILD = {
    "gc on": "import gc, importlib; importlib.import_module({m!r}); gc.collect()",
    "paused": (
        "import gc, importlib\n"
        "from prime_rl.runtime.imports import heavy_imports\n"
        "with heavy_imports(freeze=True):\n"
        "    importlib.import_module({m!r})\n"
        "gc.collect()"
    ),
    "floor": "import gc, importlib; gc.disable(); importlib.import_module({m!r})",
}

REPORT = "\nimport resource; r = resource.getrusage(resource.RUSAGE_SELF); print(r.ru_utime + r.ru_stime)"


def cpu_s(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", code + REPORT], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(
        f"{'imports of':<14} {'gc on':>7} {'paused':>7} {'floor':>7} {'paused/on':>10} {'paused/floor':>13}"
    )
    for name, module in IMPORTS.items():
        times: dict[str, list[float]] = {way: [] for way in CHILD}
        for _ in range(args.repeats):  # alternating: a machine's load drifts over the run
            for way, code in CHILD.items():
                times[way].append(cpu_s(code.format(m=module)))
        on, paused, floor = (statistics.median(times[w]) for w in ("gc on", "paused", "floor"))
        print(
            f"{name:<14} {on:>6.2f}s {paused:>6.2f}s {floor:>6.2f}s {paused / on:>10.2f} {paused / floor:>13.2f}"
        )


if __name__ == "__main__":
    main()
