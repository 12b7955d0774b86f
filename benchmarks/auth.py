"""What signed requests cost on the rollout path: signing and checking a request against the time
that request takes on a real vLLM server, in one run.

    uv run python benchmarks/auth.py [--model models/reverse_text-tiny] [--requests 64]

1. The client's side: a signature of a rollout group's request as the orchestrator sends it (200
   prompt token ids, n = 8): a SHA-256 of the body and an HMAC.
2. The server's side: the door (`inference/authenticated.py`) around a no-op ASGI app against the
   bare app, per freshly signed request (its body buffered and hashed, the nonce remembered).
3. A real server started with a secret: the mean wall time of a rollout group's request (8
   completions of <= 24 tokens) through the orchestrator's own client, signed.
The ratio of (1 + 2) to 3 is the share of a request's time that authentication takes; the limit is
1%. (A server's proof is asked once per 30 s per server: one request in hundreds.) Measured as a
difference of two server runs it would drown in this machine's noise: the check is microseconds.
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


def body_bytes() -> bytes:
    """A rollout group's request as the orchestrator sends it: the prompt as token ids, n = 8."""
    import json

    body = {"model": "m", "prompt": list(range(1000, 1200)), "n": 8, "temperature": 1.0, "top_p": 1.0,
            "logprobs": 0, "max_tokens": 24, "return_token_ids": True}  # fmt: skip
    return json.dumps(body).encode()


def sign_cost_s(calls: int = 5000) -> float:
    """The client's side: one signature (a digest of the body, an HMAC) per request."""
    from prime_rl.auth import clients, signing

    key, body, url = signing.request_key(), body_bytes(), "http://127.0.0.1:8000/v1/completions"
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            clients.sign_headers(key, "POST", url, body)
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def check_cost_s(calls: int = 5000) -> float:
    """The server's side: the door (`Authenticated`) around a no-op app against the bare app, each
    request signed afresh (a signature is taken once)."""
    from prime_rl.auth import signing
    from prime_rl.inference.authenticated import Authenticated

    async def bare(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    body, key = body_bytes(), signing.request_key()

    def scopes(signed: bool) -> list[dict]:
        return [
            {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "client": ("127.0.0.1", 1),
             "headers": [(b"content-type", b"application/json")]
             + ([(b"authorization", signing.sign(key, "POST", "/v1/completions", body).encode())] if signed else [])}
            for _ in range(calls)
        ]  # fmt: skip

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        pass

    async def per_call(app, batch: list[dict]) -> float:
        t0 = time.perf_counter()
        for scope in batch:
            await app(scope, receive, send)
        return (time.perf_counter() - t0) / len(batch)

    plain = min(asyncio.run(per_call(bare, scopes(False))) for _ in range(3))
    guarded = min(asyncio.run(per_call(Authenticated(bare), scopes(True))) for _ in range(3))
    return max(0.0, guarded - plain)


async def request_s(base: str, model: str, requests: int) -> float:
    """A rollout group's request through the orchestrator's own client (signed, the server proved)."""
    from prime_rl.engine.sampling import SamplingArgs
    from prime_rl.orchestrator.envs.sampler import ServerSampler

    sampler = ServerSampler(base, model, timeout_s=300, retries=0)
    args = SamplingArgs(temperature=1.0, max_tokens=24)
    prompt = list(range(100, 140))
    try:
        for _ in range(4):  # warm-up
            await sampler.sample(prompt, args, n=8)
        times = []
        for _ in range(requests):
            t0 = time.perf_counter()
            await sampler.sample(prompt, args, n=8)
            times.append(time.perf_counter() - t0)
    finally:
        await sampler.close()
    return statistics.mean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "models" / "reverse_text-tiny"))
    parser.add_argument("--requests", type=int, default=64)
    args = parser.parse_args()
    os.environ["PRIME_RL_SECRET"] = SECRET  # the server inherits it
    sign, check = sign_cost_s(), check_cost_s()
    with tempfile.TemporaryDirectory() as tmp:
        proc, base = start_server(args.model, 256, Path(tmp))
        try:
            per_request = asyncio.run(request_s(base, args.model, args.requests))
        finally:
            stop_server(proc)
    total = sign + check
    print(f"signing a request (client): {sign * 1e6:.1f} us; checking it (server): {check * 1e6:.1f} us")
    print(f"a rollout group's request (8 x <= 24 tokens) on a real server: {per_request * 1e3:.1f} ms")
    print(
        f"signed requests / request time: {total / per_request:.5f} ({100 * total / per_request:.3f}%; limit 1%)"
    )


if __name__ == "__main__":
    main()
