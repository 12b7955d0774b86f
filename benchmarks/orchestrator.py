"""Orchestrator overhead: rollouts/s through scheduling, advantages, packing and sending, with
instant rollouts and a null trainer sink; event-loop lag with 1,000 in flight; and the CPU each
process spends per rollout on the real rollout path, in process and with env workers.

    uv run python benchmarks/orchestrator.py [--steps 6] [--batch-size 1024] [--workers 2]

Part 1, the loop alone (this process pinned to one core, zmq to a sink subprocess that drops what it
receives):
1. Orchestrator alone: the env's `run_group` returns finished rollouts at once (64 prompt and 32
   completion tokens, half right, half wrong, so every rollout is packed and sent).
2. Event-loop lag: the same, but each rollout takes 0.5-1.5 s, with `max_inflight_rollouts` = 1000.
   A probe task sleeps 10 ms in a loop and records how late it wakes up (from step 1 on).
3. The real path (reverse-text) with a second reward function that burns 50 ms of CPU per rollout,
   run by the reward runner's worker threads (`orchestrator.rewards`), `--slow-batch-size` rollouts
   per step: rollouts/s is then the reward's bound, and the loop lag is what the rest sees.

Part 2, CPU per rollout by process (not pinned: CPU time is what counts): the real orchestrator (its
seats, token-in turns, scoring, its server sampler) against a fake vLLM server in its own process
(`/v1/completions` on loopback, each distinct reply built once, its CPU not counted), single-turn
(reverse-text) and 3-turn (digit-sum-feedback, whose replies are never in the answer format), each:
- in process (`env_workers = 0`);
- with `--workers` env workers.
The modes take turns `--repeats` times, and each keeps its least-CPU run. CPU is counted over steps 1.. (step 0 includes start-up): this process's `process_time` (the loop,
and in process also the envs) and each worker's utime + stime from /proc, per rollout finished.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prime_rl.engine.sampling import Completion
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs import client as client_module
from prime_rl.orchestrator.envs import local as local_module
from prime_rl.orchestrator.envs.local import LocalEnvs
from prime_rl.orchestrator.envs.scoring import Hook
from prime_rl.orchestrator.loop import servers as servers_module
from prime_rl.orchestrator.loop.orchestrator import Orchestrator
from prime_rl.orchestrator.loop.workers import WorkerPool
from prime_rl.orchestrator.rollout import Rollout, Turn
from prime_rl.runtime.monitor import read_metrics
from prime_rl.runtime.net import free_port

SINK = """
import sys, zmq
sock = zmq.Context().socket(zmq.PULL)
sock.setsockopt(zmq.RCVHWM, 16)
sock.connect(sys.argv[1])
while True:
    sock.recv(copy=False)
"""


class InstantSampler:
    """Answers every model call at once from a cache: half right, half wrong (by call count)."""

    def __init__(self):
        self.calls = 0
        self._cache: dict[tuple, Completion] = {}

    async def sample(self, prompt_ids, args, n=1):
        out = []
        for _ in range(n):
            self.calls += 1
            key = (len(prompt_ids), tuple(prompt_ids[-3:]), self.calls % 2)
            if key not in self._cache:
                ids = [*[int(t) for t in prompt_ids[-8:]][:: 1 if self.calls % 2 else -1], 2]
                self._cache[key] = Completion(ids, [-0.5] * len(ids), "x" * (len(ids) - 1), "stop")
            out.append(self._cache[key])
        return out

    async def close(self):
        pass


def make_config(
    out: Path, port: int, batch_size: int, steps: int, inflight: int, env: str = "reverse-text",
    base_url: str = "http://fake/v1", env_workers: int = 0,
) -> OrchestratorConfig:  # fmt: skip
    return OrchestratorConfig(
        output_dir=str(out),
        model={"name": str(Path(__file__).resolve().parents[1] / "models" / "reverse_text-tiny")},
        max_steps=steps,
        batch_size=batch_size,
        max_async_level=1000,  # no trainer publishes weights: never wait for them
        max_inflight_rollouts=inflight,
        seq_len=2048,
        env_workers=env_workers,
        envs=[{"id": env, "group_size": 8, "sampling": {"max_tokens": 64}}],
        client={"base_urls": [base_url], "health_interval_s": 3600},
        transport={"type": "zmq", "port": port, "run_id": "bench"},
        filters=[],
    )


class InstantEnv:
    """Stands in for a loaded env: `run_group` returns finished rollouts after `delay_s`."""

    requires_group_rollouts = False

    def __init__(self, delay_s: tuple[float, float] = (0.0, 0.0)):
        self.delay_s = delay_s
        self.calls = 0

    async def close(self):
        pass

    def task(self, data: dict) -> dict:
        return data

    async def run_group(
        self, task, example_id, size, sampler, renderer, model, args, env_name, version, *rest
    ):
        out = []
        if self.delay_s[1]:  # the group's rollouts run side by side: the group takes one of them
            await asyncio.sleep(random.uniform(*self.delay_s))
        for _ in range(size):
            self.calls += 1
            ids = [self.calls % 1000 + i for i in range(32)]
            out.append(
                Rollout(env_name, example_id, version, reward=float(self.calls % 2),
                        turns=[Turn(list(range(64)), ids, [1] * 32, [-0.5] * 32)], prompt=task["prompt"],
                        completion=[{"role": "assistant", "content": "x" * 32}], stop_condition="stop")
            )  # fmt: skip
        return out


def burn_50ms(completion, **kwargs) -> float:
    end = time.thread_time() + 0.05
    while time.thread_time() < end:
        pass
    return 0.0


def use_env(env_factory, extra_reward=None) -> None:
    """Make the in-process env side run groups with `env_factory()` (None: the real env), or give
    the real env one more (zero-weight) reward function, run by the orchestrator's reward runner."""
    real = local_module.__dict__.setdefault("_real_load_env", local_module.load_env)

    def load(config, rewards=None, *rest, **kw):
        env = real(config, rewards, *rest, **kw)
        if env_factory is not None:
            env.vf_env = env_factory()
        if extra_reward is not None:
            env.vf_env.scorer.extra.append(Hook(extra_reward, extra_reward.__name__, "reward", 0.0))
        return env

    local_module.load_env = load


FAKE_VLLM = r"""
import json, sys
import uvicorn

cache, count = {}, [0]


def answer(body):
    n = body.get("n", 1)
    prompt = body["prompt"]
    choices = []
    for i in range(n):
        count[0] += 1
        right = count[0] % 2 == 0
        key = (len(prompt), tuple(prompt[-4:]), right)
        if key not in cache:
            ids = prompt[-8:][:: -1 if right else 1] + [2]
            cache[key] = {"text": "x" * 8, "finish_reason": "stop", "token_ids": ids,
                          "logprobs": {"token_logprobs": [-0.5] * len(ids)}}
        choices.append({"index": i, **cache[key]})
    return {"id": "cmpl-0", "object": "text_completion", "model": body["model"], "choices": choices}


async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    reply = json.dumps(answer(json.loads(body))).encode() if scope["path"].endswith("/completions") else b"{}"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": reply})


uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", timeout_keep_alive=75)
"""


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class MeasuredOrchestrator(Orchestrator):
    """Takes each process's CPU time at the start of step 1 and at the end of the last step."""

    cpu: dict[str, tuple[float, float]]

    def _snapshot(self) -> dict[str, float]:
        pids = self.env_side.pids() if isinstance(self.env_side, WorkerPool) else []
        return {"loop": time.process_time(), **{f"worker {i}": proc_cpu_s(p) for i, p in enumerate(pids)}}

    async def _step(self, step: int) -> None:
        if step == 1:
            self._t0 = self._snapshot()
        await super()._step(step)
        if step == self.config.max_steps - 1:
            t1 = self._snapshot()
            self.cpu = {k: t1[k] - self._t0[k] for k in t1 if k in self._t0}


def cpu_per_rollout(config: OrchestratorConfig) -> dict[str, float]:
    """Per process, ms of CPU per rollout finished over steps 1.."""
    side = (
        LocalEnvs(config)
        if config.env_workers == 0
        else WorkerPool(config, LocalEnvs(config, rollouts=False))
    )
    orch = MeasuredOrchestrator(config, side)
    asyncio.run(orch.run())
    metrics = read_metrics(Path(config.output_dir) / "orchestrator" / "metrics.jsonl")[1:]
    n = sum(m[f"rollouts/all/{b}"] for m in metrics for b in ("trained", "filtered", "failed"))
    return {k: v / n * 1e3 for k, v in orch.cpu.items()}


class ProbedOrchestrator(Orchestrator):
    """Records event-loop lag from step 1 on (step 0 includes one-time warm-up)."""

    lags: list[float]

    async def setup(self):
        progress = await super().setup()
        self.lags = []

        async def probe():
            while True:
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                self.lags.append(time.perf_counter() - t - 0.01)

        self._probe = asyncio.create_task(probe())
        return progress

    async def _step(self, step: int) -> None:
        if step == 1:
            self.lags.clear()
        await super()._step(step)


def run(config: OrchestratorConfig) -> tuple[float, list[float]]:
    """Rollouts/s over steps 1.. (step 0 includes start-up), and the event-loop lags."""
    orch = ProbedOrchestrator(config, LocalEnvs(config))
    asyncio.run(orch.run())
    metrics = read_metrics(Path(config.output_dir) / "orchestrator" / "metrics.jsonl")[1:]
    rollouts = sum(m["rollouts/all/trained"] + m["rollouts/all/filtered"] for m in metrics)
    return rollouts / sum(m["time/step"] for m in metrics), orch.lags


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def loop_alone(args, port: int, tmp: str) -> None:
    """Part 1: the loop's own rate and lag, against an in-process fake sampler."""
    sampler = InstantSampler()
    real_get, real_wait = client_module.Clients.get, servers_module.ServerPool.wait_healthy
    client_module.Clients.get = lambda self, base_url, model=None: sampler  # every server is the fake
    servers_module.ServerPool.wait_healthy = lambda self: asyncio.sleep(0)
    try:
        bs, steps = args.batch_size, args.steps
        use_env(InstantEnv)
        alone, alone_lags = run(make_config(Path(tmp) / "alone", port, bs, steps, inflight=bs))
        use_env(lambda: InstantEnv(delay_s=(0.5, 1.5)))
        slow, lags = run(make_config(Path(tmp) / "lag", port, 1000, steps, inflight=1000))
        sbs = args.slow_batch_size
        use_env(None, extra_reward=burn_50ms)
        burn, burn_lags = run(make_config(Path(tmp) / "burn", port, sbs, steps, inflight=sbs))
        use_env(None)
    finally:
        client_module.Clients.get, servers_module.ServerPool.wait_healthy = real_get, real_wait

    def ms(values, q):
        return f"{percentile(values, q) * 1e3:.1f}"

    print(f"Part 1: the loop on 1 core, reverse-text, groups of 8, {steps} steps (rates over steps 1..)\n")
    print(
        "| run | rollouts per step | in flight | rollouts/s | ratio to alone | loop lag p50 / p99 / max ms |"
    )
    print("|---|---|---|---|---|---|")
    for name, rate, n, ls in (
        ("orchestrator alone (instant rollouts)", alone, bs, alone_lags),
        ("rollouts take 0.5-1.5 s", slow, 1000, lags),
        ("real path, single-turn, + a reward burning 50 ms CPU", burn, sbs, burn_lags),
    ):
        print(f"| {name} | {n} | up to {n} | {rate:,.0f} | {rate / alone:.3f} | "
              f"{ms(ls, 0.5)} / {ms(ls, 0.99)} / {max(ls) * 1e3:.1f} |")  # fmt: skip


def cpu_by_process(args, port: int, tmp: str) -> None:
    """Part 2: CPU per rollout of each process, in process and with env workers."""
    http_port = free_port()
    fake = subprocess.Popen([sys.executable, "-c", FAKE_VLLM, str(http_port)])
    base_url = f"http://127.0.0.1:{http_port}/v1"
    try:
        asyncio.run(servers_module.wait_healthy(base_url.removesuffix("/v1"), 60))
        rows = []
        modes = (("in process", 0), (f"{args.workers} env workers", args.workers))
        for env, label in (("reverse-text", "single-turn"), ("digit-sum-feedback", "3-turn")):
            results: dict[str, dict[str, float]] = {}
            # The modes take turns, `--repeats` times; each keeps its run with the least CPU in all,
            # the one least disturbed by the rest of this shared machine.
            for r in range(args.repeats):
                for mode, workers in modes:
                    out = Path(tmp) / f"cpu-{env}-{workers}-{r}"
                    config = make_config(out, port, args.batch_size, args.steps, inflight=args.batch_size,
                                         env=env, base_url=base_url, env_workers=workers)  # fmt: skip
                    cpu = cpu_per_rollout(config)
                    if mode not in results or sum(cpu.values()) < sum(results[mode].values()):
                        results[mode] = cpu
            before = sum(results["in process"].values())
            for mode, cpu in results.items():
                workers = " / ".join(f"{v:.2f}" for k, v in cpu.items() if k != "loop") or "-"
                total = sum(cpu.values())
                rows.append(
                    f"| {label} | {mode} | {cpu['loop']:.2f} | {workers} | {total:.2f} | {total / before:.2f} |"
                )
    finally:
        fake.kill()
    print(f"\nPart 2: CPU per rollout by process (ms), groups of 8, {args.batch_size} rollouts per step, "
          f"{args.steps} steps (CPU over steps 1..)\n")  # fmt: skip
    print("| env | mode | orchestrator process | each env worker | all processes | ratio to in process |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--slow-batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--parts", nargs="+", type=int, default=[1, 2])
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    port = free_port()
    sink_env = {**os.environ, "PYTHONPATH": ""}
    sink = subprocess.Popen([sys.executable, "-c", SINK, f"tcp://127.0.0.1:{port}"], env=sink_env,
                            preexec_fn=lambda: os.sched_setaffinity(0, cores[-1:]))  # fmt: skip
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if 1 in args.parts:
                os.sched_setaffinity(0, cores[:1])
                loop_alone(args, port, tmp)
                os.sched_setaffinity(0, cores)
            if 2 in args.parts:
                cpu_by_process(args, port, tmp)
    finally:
        sink.kill()


if __name__ == "__main__":
    main()
