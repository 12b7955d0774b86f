"""The sandbox's cost: a bare subprocess against the same command in a sandbox, a tool call in the
sandboxed tool host against the same call in process, and a tool env's rollouts with and without
the sandbox, each pair measured in one run, interleaved.

    uv run python benchmarks/sandbox.py [--runs 30] [--groups 32]

1. Commands: `true` (the start alone: namespaces, mounts, the user switch, the teardown) and
   `python -c 'print(sum(range(1000)))'` (a small Python program, interpreter start included):
   median wall time of each, bare and sandboxed, and the ratio.
2. The tool host (started once): a session (a warm worker) and one small call in it, against the
   same function called in this process.
3. A tool env: `--groups` groups of 8 tool-add rollouts (a call of its `add` tool, then the answer),
   played with scripted model replies through the orchestrator's own path (seats, token-in, tools,
   scoring) with its tools in the sandbox and in process. Prints the wall time and the CPU time (this
   process, plus the sandbox's processes) per rollout, and what the sandbox adds to a step of
   `--groups` x 8 rollouts: the figure to hold against the step's time (tool-add's config: 32
   groups, about 3 s a step on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from prime_rl.engine.sampling import SamplingArgs
from prime_rl.orchestrator.envs.renderer import Renderer
from prime_rl.orchestrator.envs.v1_env import load_v1_env
from prime_rl.sandbox.bwrap import python_paths
from prime_rl.sandbox.config import SandboxConfig
from prime_rl.sandbox.run import run
from prime_rl.sandbox.tools_host import ToolsHost

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.scripted import Scripted

TOOL_MODEL = str(Path(__file__).resolve().parents[1] / "models" / "tool_add-tiny")


async def bare(argv: list[str]) -> None:
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    await proc.communicate()


async def sandboxed(argv: list[str], config: SandboxConfig, paths: list[str]) -> None:
    result = await run(argv, config, read_only=paths)
    assert result.ok, result


async def commands(runs: int) -> None:
    config, paths = SandboxConfig(), python_paths()
    argvs = {"true": ["true"], "python tool": [sys.executable, "-c", "print(sum(range(1000)))"]}
    print(f"{'command':<14}{'bare ms':>10}{'sandbox ms':>12}{'ratio':>8}{'overhead ms':>13}")
    for name, argv in argvs.items():
        times: dict[str, list[float]] = {"bare": [], "sandbox": []}
        for i in range(runs + 2):
            for mode in ("bare", "sandbox"):
                t0 = time.perf_counter()
                await (bare(argv) if mode == "bare" else sandboxed(argv, config, paths))
                if i >= 2:  # warm-up: the first runs load the page cache
                    times[mode].append(time.perf_counter() - t0)
        b, s = (statistics.median(times[m]) * 1e3 for m in ("bare", "sandbox"))
        print(f"{name:<14}{b:>10.1f}{s:>12.1f}{s / b:>8.2f}{s - b:>13.1f}")


async def tool_host(runs: int) -> None:
    host = await ToolsHost.start(["json"], SandboxConfig())
    try:
        spans: dict[str, list[float]] = {"session": [], "call": [], "close": [], "in process": []}
        for i in range(runs + 2):
            t0 = time.perf_counter()
            session = await host.session(10)
            t1 = time.perf_counter()
            await session.call("json:dumps", {"obj": [1, 2, 3]}, 10)
            t2 = time.perf_counter()
            await session.close()
            t3 = time.perf_counter()
            json.dumps([1, 2, 3])
            t4 = time.perf_counter()
            if i >= 2:
                for key, span in zip(spans, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    spans[key].append(span)
        print("tool host: " + ", ".join(f"{k} {statistics.median(v) * 1e3:.3f} ms" for k, v in spans.items()))
    finally:
        await host.close()


def sandbox_cpu_s() -> float:
    """CPU seconds of the sandboxes' processes that run now (their users: 200000 and up), their
    reaped children included."""
    total, tick = 0, os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid >= 200_000:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += sum(int(x) for x in fields[11:15])
        except OSError:
            pass
    return total / tick


async def tool_env(groups: int, rounds: int) -> None:
    renderer = Renderer.for_model(TOOL_MODEL)
    replies = [
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
        "<answer>3</answer>",
    ]
    envs = {
        "sandbox": load_v1_env("tool-add", {}, SandboxConfig()),
        "in process": load_v1_env("tool-add", {}, None),
    }
    spans: dict[str, list[tuple[float, float]]] = {k: [] for k in envs}

    async def one_step(env) -> None:
        async def group():
            out = await env.run_group(
                env.first, 0, 8, Scripted(renderer, replies), renderer, "m", SamplingArgs(max_tokens=32),
                "tool-add", 0, [], 60,
            )  # fmt: skip
            assert not any(r.failed for r in out), [r.error for r in out]

        await asyncio.gather(*(group() for _ in range(groups)))

    try:
        for i in range(rounds + 1):
            for name, env in envs.items():
                w0, c0, s0 = time.perf_counter(), time.process_time(), sandbox_cpu_s()
                await one_step(env)
                await asyncio.sleep(0.2)  # the workers' clean-up after their sessions, counted
                wall = time.perf_counter() - w0 - 0.2
                cpu = time.process_time() - c0 + sandbox_cpu_s() - s0
                if i >= 1:  # the first round starts the tool host
                    spans[name].append((wall, cpu))
        n = groups * 8
        print(f"tool env ({groups} groups of 8 tool-add rollouts, scripted replies, {rounds} rounds):")
        med = {k: tuple(statistics.median(s[j] for s in v) for j in (0, 1)) for k, v in spans.items()}
        for name, (wall, cpu) in med.items():
            print(f"  {name:<11} wall {wall * 1e3 / n:.2f} ms/rollout, CPU {cpu * 1e3 / n:.2f} ms/rollout")
        (ws, cs), (wp, cp) = med["sandbox"], med["in process"]
        print(
            f"  the sandbox adds {(cs - cp) * 1e3 / n:.2f} ms CPU per rollout: {cs - cp:.3f} s CPU per step of "
            f"{n} rollouts (wall {ws - wp:+.3f} s; ratio sandbox/in process: CPU {cs / cp:.2f}x, wall {ws / wp:.2f}x)"
        )
    finally:
        for env in envs.values():
            await env.close()


async def main(runs: int, groups: int, rounds: int) -> None:
    await commands(runs)
    await tool_host(runs)
    await tool_env(groups, rounds)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    asyncio.run(main(args.runs, args.groups, args.rounds))
