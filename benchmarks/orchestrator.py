"""Orchestrator overhead: rollouts/s through scheduling, advantages, packing and sending, with
instant rollouts and a null trainer sink, on one core; and event-loop lag with 1,000 in flight.

    uv run python benchmarks/orchestrator.py [--steps 6] [--batch-size 1024]

Three runs of the real orchestrator (reverse-text dataset, groups of 8, zmq to a sink subprocess on
another core that drops what it receives; this process pinned to one core):
1. Orchestrator alone: the env's `run_rollout` returns a verifiers-shaped output at once (64 prompt
   and 32 completion tokens, half right, half wrong, so every rollout is packed and sent).
2. Event-loop lag: the same, but each rollout takes 0.5-1.5 s, with `max_inflight_rollouts` = 1000.
   A probe task sleeps 10 ms in a loop and records how late it wakes up (from step 1 on).
3. The real path: verifiers' `run_rollout` and the OpenAI client against an instant fake server
   (an in-process httpx2 mock transport, openai's own HTTP library: no sockets, each distinct reply built once), so the ratio
   to run 1 shows what the env library costs per rollout next to the orchestrator.
4. The same with the multi-turn env digit-sum-feedback: the fake server's replies are never in the
   answer format, so every rollout takes three model turns and two env turns (one sample each).
5. The real path (reverse-text) with a second reward function that burns 50 ms of CPU per rollout,
   run by the reward runner's worker threads (`orchestrator.rewards`), `--slow-batch-size` rollouts
   per step: rollouts/s is then the reward's bound, and the loop lag is what the rest sees.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2

from prime_rl.monitor import read_metrics
from prime_rl.net import free_port
from prime_rl.orchestrator import client as client_module
from prime_rl.orchestrator import orchestrator as orchestrator_module
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.orchestrator import Orchestrator

SINK = """
import sys, zmq
sock = zmq.Context().socket(zmq.PULL)
sock.setsockopt(zmq.RCVHWM, 16)
sock.connect(sys.argv[1])
while True:
    sock.recv(copy=False)
"""


class InstantServer:
    """Answers chat completions the way vLLM does with token ids and logprobs, from a cache."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.requests = 0
        self._cache: dict[tuple[str, bool], bytes] = {}

    def reply(self, body: dict, right: bool) -> bytes:
        user = body["messages"][-1]["content"]
        key = (user, right)
        if key not in self._cache:
            text = user[::-1] if right else user[: len(user) // 2]
            ids = list(text.encode())
            prompt = "".join(str(m.get("content")) for m in body["messages"])
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
                "token_ids": ids,
                "logprobs": {"content": [{"token": chr(t), "logprob": -0.5, "bytes": [t], "top_logprobs": []} for t in ids]},
            }  # fmt: skip
            out = {
                "id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": body["model"],
                "choices": [choice], "prompt_token_ids": list(prompt.encode()),
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids), "total_tokens": len(prompt) + len(ids)},
            }  # fmt: skip
            self._cache[key] = json.dumps(out).encode()
        return self._cache[key]

    async def handle(self, request: httpx2.Request) -> httpx2.Response:
        self.requests += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        body = json.loads(request.content)
        data = self.reply(body, right=self.requests % 2 == 0)
        return httpx2.Response(200, content=data, headers={"content-type": "application/json"})

    def client(self, base_url: str, config):
        import verifiers as vf
        from openai import AsyncOpenAI, DefaultAsyncHttpxClient

        http = DefaultAsyncHttpxClient(transport=httpx2.MockTransport(self.handle), base_url=base_url)
        return vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=base_url, api_key="x", http_client=http))


def make_config(
    out: Path, port: int, batch_size: int, steps: int, inflight: int, env: str = "reverse-text"
) -> OrchestratorConfig:
    return OrchestratorConfig(
        output_dir=str(out),
        max_steps=steps,
        batch_size=batch_size,
        max_async_level=1000,  # no trainer publishes weights: never wait for them
        max_inflight_rollouts=inflight,
        seq_len=2048,
        envs=[{"id": env, "group_size": 8, "sampling": {"max_tokens": 64}}],
        client={"base_urls": ["http://fake/v1"], "health_interval_s": 3600},
        transport={"type": "zmq", "port": port, "run_id": "bench"},
        filters=[],
    )


class InstantEnv:
    """Stands in for a verifiers env: `run_rollout` returns a finished output after `delay_s`."""

    def __init__(self, delay_s: tuple[float, float] = (0.0, 0.0)):
        self.delay_s = delay_s
        self.calls = 0

    async def run_rollout(self, inp, client, model, args, state_columns=()):
        self.calls += 1
        if self.delay_s[1]:
            await asyncio.sleep(random.uniform(*self.delay_s))
        ids = [self.calls % 1000 + i for i in range(32)]
        return {
            "example_id": inp["example_id"], "reward": float(self.calls % 2), "metrics": {},
            "prompt": inp["prompt"], "completion": [{"role": "assistant", "content": "x" * 32}],
            "is_truncated": False, "stop_condition": "stop",
            "trajectory": [{"tokens": {"prompt_ids": list(range(64)), "completion_ids": ids,
                                       "completion_mask": [1] * 32, "completion_logprobs": [-0.5] * 32}}],
        }  # fmt: skip


def burn_50ms(completion, **kwargs) -> float:
    end = time.thread_time() + 0.05
    while time.thread_time() < end:
        pass
    return 0.0


def use_env(env_factory, extra_reward=None) -> None:
    """Make the orchestrator's envs run rollouts with `env_factory()` (None: the real env), or give
    the real env one more (zero-weight) reward function, run by the orchestrator's reward runner."""
    real = orchestrator_module.__dict__.setdefault("_real_load_env", orchestrator_module.load_env)

    def load(config, seed, cursor=None, rewards=None):
        env = real(config, seed, cursor, rewards)
        if env_factory is not None:
            env.vf_env = env_factory()
        if extra_reward is not None:
            env.vf_env.rubric.add_reward_func(extra_reward, weight=0.0)
            rewards.install(env.vf_env)
        return env

    orchestrator_module.load_env = load


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
    orch = ProbedOrchestrator(config)
    asyncio.run(orch.run())
    metrics = read_metrics(Path(config.output_dir) / "orchestrator" / "metrics.jsonl")[1:]
    rollouts = sum(m["rollouts/all/trained"] + m["rollouts/all/filtered"] for m in metrics)
    return rollouts / sum(m["time/step"] for m in metrics), orch.lags


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--slow-batch-size", type=int, default=64)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cores[:1])
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    port = free_port()
    sink_env = {**os.environ, "PYTHONPATH": ""}
    sink = subprocess.Popen([sys.executable, "-c", SINK, f"tcp://127.0.0.1:{port}"], env=sink_env,
                            preexec_fn=lambda: os.sched_setaffinity(0, cores[-1:]))  # fmt: skip
    try:
        server = InstantServer()
        client_module.make_vf_client = server.client  # every server of the pool is the fake
        client_module.ServerPool.wait_healthy = lambda self: asyncio.sleep(0)
        with tempfile.TemporaryDirectory() as tmp:
            bs, steps = args.batch_size, args.steps
            use_env(InstantEnv)
            alone, alone_lags = run(make_config(Path(tmp) / "alone", port, bs, steps, inflight=bs))
            use_env(lambda: InstantEnv(delay_s=(0.5, 1.5)))
            slow, lags = run(make_config(Path(tmp) / "lag", port, 1000, steps, inflight=1000))
            use_env(None)
            real, real_lags = run(make_config(Path(tmp) / "real", port, bs, steps, inflight=bs))
            multi, multi_lags = run(
                make_config(Path(tmp) / "multi", port, bs, steps, inflight=bs, env="digit-sum-feedback")
            )
            sbs = args.slow_batch_size
            use_env(None, extra_reward=burn_50ms)
            burn, burn_lags = run(make_config(Path(tmp) / "burn", port, sbs, steps, inflight=sbs))
    finally:
        sink.kill()

    def ms(values, q):
        return f"{percentile(values, q) * 1e3:.1f}"

    print(f"1 core (this process), reverse-text dataset, groups of 8, {steps} steps (rates over steps 1..)\n")
    print(
        "| run | rollouts per step | in flight | rollouts/s | ratio to alone | loop lag p50 / p99 / max ms |"
    )
    print("|---|---|---|---|---|---|")
    for name, rate, n, ls in (
        ("orchestrator alone (instant rollouts)", alone, bs, alone_lags),
        ("rollouts take 0.5-1.5 s", slow, 1000, lags),
        ("verifiers + OpenAI client, instant server", real, bs, real_lags),
        ("the same, multi-turn env (3 model turns per rollout)", multi, bs, multi_lags),
        ("the same, single-turn, + a reward burning 50 ms CPU", burn, sbs, burn_lags),
    ):
        print(f"| {name} | {n} | up to {n} | {rate:,.0f} | {rate / alone:.3f} | "
              f"{ms(ls, 0.5)} / {ms(ls, 0.99)} / {max(ls) * 1e3:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
