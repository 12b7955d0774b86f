"""The sandbox's cost per run: a bare subprocess against the same command in a sandbox, measured in
one run, interleaved.

    uv run python benchmarks/sandbox.py [--runs 30]

Commands: `true` (the start alone: namespaces, mounts, the user switch, the teardown) and
`python -c 'print(sum(range(1000)))'` (what a small Python tool call costs, interpreter start
included). Prints the median wall time of each and the ratio. Then the tool host (`tools_host.py`,
started once): a session (a forked child) and one call in it, against the same function called in
this process.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

from prime_rl.sandbox.bwrap import python_paths
from prime_rl.sandbox.config import SandboxConfig
from prime_rl.sandbox.run import run
from prime_rl.sandbox.tools_host import ToolsHost


async def bare(argv: list[str]) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    await proc.communicate()


async def sandboxed(argv: list[str], config: SandboxConfig, paths: list[str]) -> None:
    result = await run(argv, config, read_only=paths)
    assert result.ok, result


async def main(runs: int) -> None:
    config, paths = SandboxConfig(), python_paths()
    commands = {"true": ["true"], "python tool": [sys.executable, "-c", "print(sum(range(1000)))"]}
    print(f"{'command':<14}{'bare ms':>10}{'sandbox ms':>12}{'ratio':>8}{'overhead ms':>13}")
    for name, argv in commands.items():
        times: dict[str, list[float]] = {"bare": [], "sandbox": []}
        for i in range(runs + 2):
            for mode in ("bare", "sandbox"):
                t0 = time.perf_counter()
                await (bare(argv) if mode == "bare" else sandboxed(argv, config, paths))
                if i >= 2:  # warm-up: the first runs load the page cache
                    times[mode].append(time.perf_counter() - t0)
        b, s = (statistics.median(times[m]) * 1e3 for m in ("bare", "sandbox"))
        print(f"{name:<14}{b:>10.1f}{s:>12.1f}{s / b:>8.2f}{s - b:>13.1f}")

    host = await ToolsHost.start(["json"], config)
    try:
        spans: dict[str, list[float]] = {"session": [], "call": [], "in process": []}
        for i in range(runs + 2):
            t0 = time.perf_counter()
            session = await host.session()
            t1 = time.perf_counter()
            await session.call("json:dumps", {"obj": [1, 2, 3]}, 10)
            t2 = time.perf_counter()
            await session.close()
            t3 = time.perf_counter()
            __import__("json").dumps([1, 2, 3])
            t4 = time.perf_counter()
            if i >= 2:
                spans["session"].append(t1 - t0)
                spans["call"].append(t2 - t1)
                spans["in process"].append(t4 - t3)
        print("tool host: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.3f} ms" for k, v in spans.items()))
    finally:
        await host.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    asyncio.run(main(ap.parse_args().runs))
