"""What the run secret costs on the rollout path: the server's check of every request against the
time that request takes on a real vLLM server, in one run.

    uv run python benchmarks/auth.py [--model models/reverse_text-tiny] [--requests 64]

1. The check alone: `vllm_server.Authenticated` around a no-op ASGI app against the bare app,
   per request (the client's side is one header more in a request it builds anyway).
2. A real server started with a secret: the mean wall time of a rollout-sized chat request (a group
   of 8 completions of <= 24 tokens, as the short geometry of docs/benchmarks.md), sent with it.
The ratio of the two is the share of a request's time that authentication takes. (Measured as a
difference of two server runs it would drown in this machine's noise: the check is microseconds.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from generation import REPO, start_server, stop_server

SECRET = "benchmark-secret-0123456789abcdef0123456789"


async def per_call_s(app, scope: dict, calls: int) -> float:
    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            await app(scope, receive, send)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def check_cost_s(calls: int = 20000) -> float:
    from prime_rl import secret
    from prime_rl.inference.vllm_server import Authenticated

    async def bare(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"content-type", b"application/json"), (b"authorization", f"Bearer {SECRET}".encode())],
        "client": ("127.0.0.1", 1),
    }
    secret.value.cache_clear()
    assert secret.accepts(f"Bearer {SECRET}")
    plain = asyncio.run(per_call_s(bare, scope, calls))
    guarded = asyncio.run(per_call_s(Authenticated(bare), scope, calls))
    return max(0.0, guarded - plain)


async def request_s(base: str, model: str, requests: int) -> float:
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Reverse the text: benchmark"}],
            "n": 8, "max_tokens": 24, "temperature": 1.0, "logprobs": True, "return_token_ids": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {SECRET}"}
    async with httpx.AsyncClient(timeout=300, headers=headers) as http:
        for _ in range(4):  # warm-up
            (await http.post(f"{base}/chat/completions", json=body)).raise_for_status()
        times = []
        for _ in range(requests):
            t0 = time.perf_counter()
            (await http.post(f"{base}/chat/completions", json=body)).raise_for_status()
            times.append(time.perf_counter() - t0)
    return statistics.mean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "models" / "reverse_text-tiny"))
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    os.environ["PRIME_RL_SECRET"] = SECRET  # the server inherits it
    check = check_cost_s()
    with tempfile.TemporaryDirectory() as tmp:
        proc, base = start_server(args.model, 256, Path(tmp))
        try:
            per_request = asyncio.run(request_s(base, args.model, args.requests))
        finally:
            stop_server(proc)
    print(f"the server's check of the secret: {check * 1e6:.1f} us per request")
    print(f"a rollout group's request (8 x <= 24 tokens) on a real server: {per_request * 1e3:.1f} ms")
    print(f"authentication / request time: {check / per_request:.5f} ({100 * check / per_request:.3f}%)")


if __name__ == "__main__":
    main()
