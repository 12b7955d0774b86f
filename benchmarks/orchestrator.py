"""Orchestrator overhead: rollouts/s through scheduling, the env, advantages, packing and sending,
against an instant fake inference server and a null trainer sink, on one core.

    uv run python benchmarks/orchestrator.py [--steps 6] [--batch-size 1024]

The fake server lives in this process as an httpx mock transport behind the real OpenAI and verifiers
clients: no sockets, and each distinct reply is built once (a group shares a prompt), so nearly all
the time measured is the orchestrator's and the env library's. Half the replies are right and half
wrong, so advantages are non-zero and every rollout is packed and sent. The sink is a zmq PULL socket
in a subprocess on another core that drops what it receives. This process is pinned to one core.

Two runs, side by side:
1. Throughput: instant replies. Baseline: the same rollouts through verifiers alone (`run_rollout`
   with the same client and concurrency, nothing else), so the ratio is the share of the per-rollout
   cost that is the env library's, and 1 - ratio the orchestrator's own.
2. Event-loop lag with 1,000 rollouts in flight: replies take 1 s, `max_inflight_rollouts` = 1000.
   A probe task sleeps 10 ms in a loop and records how late it wakes up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from prime_rl.monitor import read_metrics
from prime_rl.net import free_port
from prime_rl.orchestrator import client as client_module
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs import load_env, rollout_input
from prime_rl.orchestrator.orchestrator import Orchestrator
from prime_rl.orchestrator.scheduler import sampling_args

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

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        body = json.loads(request.content)
        data = self.reply(body, right=self.requests % 2 == 0)
        return httpx.Response(200, content=data, headers={"content-type": "application/json"})

    def client(self, base_url: str, config):
        import verifiers as vf
        from openai import AsyncOpenAI

        http = httpx.AsyncClient(transport=httpx.MockTransport(self.handle), base_url=base_url)
        return vf.OpenAIChatCompletionsClient(AsyncOpenAI(base_url=base_url, api_key="x", http_client=http))


def make_config(out: Path, port: int, batch_size: int, steps: int, inflight: int) -> OrchestratorConfig:
    return OrchestratorConfig(
        output_dir=str(out),
        max_steps=steps,
        batch_size=batch_size,
        max_async_level=1000,  # no trainer publishes weights: never wait for them
        max_inflight_rollouts=inflight,
        seq_len=2048,
        envs=[{"id": "reverse-text", "group_size": 8, "sampling": {"max_tokens": 64}}],
        client={"base_urls": ["http://fake/v1"], "health_interval_s": 3600},
        transport={"type": "zmq", "port": port, "run_id": "bench"},
        filters=[],
    )


async def run_orchestrator(config: OrchestratorConfig, probe: bool) -> tuple[float, list[float]]:
    """Run it; return rollouts/s over steps 1.. (step 0 includes start-up) and the probe's lags."""
    lags: list[float] = []

    async def lag_probe():
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            lags.append(time.perf_counter() - t - 0.01)

    task = asyncio.create_task(lag_probe()) if probe else None
    await Orchestrator(config).run()
    if task:
        task.cancel()
    metrics = read_metrics(Path(config.output_dir) / "orchestrator" / "metrics.jsonl")[1:]
    rollouts = sum(m["rollouts/all/trained"] + m["rollouts/all/filtered"] for m in metrics)
    return rollouts / sum(m["time/step"] for m in metrics), lags


async def run_verifiers_alone(server: InstantServer, n: int, inflight: int) -> float:
    config = make_config(Path(tempfile.mkdtemp()), 0, 8, 1, inflight)
    env = load_env(config.envs[0], seed=0)
    client = server.client("http://fake/v1", None)
    args = sampling_args(config.envs[0].sampling)
    limit = asyncio.Semaphore(inflight // 8)

    async def group():
        inp = rollout_input(env.examples.next())
        async with limit:
            await asyncio.gather(
                *(env.vf_env.run_rollout(dict(inp), client, config.model.name, args, state_columns=["trajectory"])
                  for _ in range(8))
            )  # fmt: skip

    await asyncio.gather(*(group() for _ in range(n // 8 // 4)))  # warm-up
    t0 = time.perf_counter()
    await asyncio.gather(*(group() for _ in range(n // 8)))
    return n / (time.perf_counter() - t0)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch-size", type=int, default=1024)
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
            cfg = make_config(Path(tmp) / "a", port, args.batch_size, args.steps, inflight=args.batch_size)
            orch_rate, _ = asyncio.run(run_orchestrator(cfg, probe=False))
            vf_rate = asyncio.run(run_verifiers_alone(server, args.batch_size * 2, args.batch_size))

            slow = InstantServer(delay_s=1.0)
            client_module.make_vf_client = slow.client
            cfg = make_config(Path(tmp) / "b", port, 1000, 4, inflight=1000)
            lag_rate, lags = asyncio.run(run_orchestrator(cfg, probe=True))
    finally:
        sink.kill()

    print(f"1 core (this process), {args.batch_size} rollouts per step, group 8, reverse-text env\n")
    print("| run | rollouts/s | verifiers alone rollouts/s | ratio |")
    print("|---|---|---|---|")
    print(f"| instant server | {orch_rate:,.0f} | {vf_rate:,.0f} | {orch_rate / vf_rate:.2f} |")
    print()
    print("| 1,000 rollouts in flight, replies after 1 s | rollouts/s | lag p50 ms | lag p99 ms | lag max ms |")
    print("|---|---|---|---|---|")
    print(
        f"| event loop | {lag_rate:,.0f} | {percentile(lags, 0.5) * 1e3:.1f} | "
        f"{percentile(lags, 0.99) * 1e3:.1f} | {max(lags) * 1e3:.1f} |"
    )


if __name__ == "__main__":
    main()
