"""Weight reload while generating: its cost next to the same reload on an idle engine, and what the
reloads cost generation.

    uv run python benchmarks/reload.py [--model models/reverse_text-tiny] [--seconds 8]

Starts `uv run inference` and publishes copies of the model as weight steps. Then, in one run:
1. idle: 5 reloads through the reload route with nothing generating;
2. busy: 16 concurrent requests of n = 8 completions of 64 tokens each, kept in flight for
   `--seconds`, first without reloads, then with a reload every ~0.5 s (the default, which keeps
   the KV cache of the running requests), then with reloads that clear it (as before 2026-11-23).
Prints the reload route's median time (client wall and the server's own pause-reload-resume)
idle and busy, and the generated tokens/s with reloads against without.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from generation import REPO, start_server, stop_server


async def measure(url: str, model: str, weights: Path, seconds: float) -> dict:
    base = url.removesuffix("/v1")
    step = 0
    async with httpx.AsyncClient(timeout=300) as http:

        async def reload(clear_cache: bool = False) -> tuple[float, float]:
            nonlocal step
            step += 1
            t0 = time.perf_counter()
            resp = await http.post(f"{base}/prime_rl/load_weights",
                                   json={"path": str(weights / f"step_{step}"), "step": step,
                                         "clear_cache": clear_cache})  # fmt: skip
            assert resp.status_code == 200, resp.text
            return time.perf_counter() - t0, resp.json()["seconds"]

        idle = [await reload() for _ in range(5)]
        tokens, stop = 0, False

        async def requests(i: int) -> None:
            nonlocal tokens
            body = {"model": model, "messages": [{"role": "user", "content": f"abcdefgh{i}"}], "n": 8,
                    "max_tokens": 64, "min_tokens": 64, "temperature": 1.0, "logprobs": True,
                    "return_token_ids": True}  # fmt: skip
            while not stop:
                resp = await http.post(f"{url}/chat/completions", json=body)
                tokens += sum(len(c["token_ids"]) for c in resp.json()["choices"])

        async def phase(with_reloads: bool, clear_cache: bool = False) -> tuple[float, list]:
            nonlocal tokens, stop
            stop = False
            workers = [asyncio.create_task(requests(i)) for i in range(16)]
            await asyncio.sleep(1.0)  # every worker has a request in flight
            tokens, t0, busy = 0, time.perf_counter(), []
            while time.perf_counter() - t0 < seconds:
                if with_reloads:
                    busy.append(await reload(clear_cache))
                await asyncio.sleep(0.5)
            rate = tokens / (time.perf_counter() - t0)
            stop = True
            await asyncio.gather(*workers)
            return rate, busy

        plain, _ = await phase(False)
        with_reloads, busy = await phase(True)
        clearing, busy_clearing = await phase(True, clear_cache=True)
    return {"idle": idle, "busy": busy, "plain": plain, "with_reloads": with_reloads,
            "busy (cache cleared)": busy_clearing, "clearing": clearing}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "models/reverse_text-tiny"))
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        weights = Path(tmp) / "weights"  # the server's weights dir (`inference` puts it there)
        for step in range(1, 60):
            folder = weights / f"step_{step}"
            folder.mkdir(parents=True)
            for f in Path(args.model).iterdir():
                if f.is_file():
                    shutil.copy(f, folder)
            (folder / "READY").touch()
        proc, url = start_server(args.model, 512, Path(tmp))
        try:
            r = asyncio.run(measure(url, args.model, weights, args.seconds))
        finally:
            stop_server(proc)

    def ms(samples: list, i: int) -> float:
        return 1e3 * statistics.median(s[i] for s in samples)

    print(f"{'reload':>22}{'wall ms':>9}{'server ms':>11}{'count':>7}")
    for name in ("idle", "busy", "busy (cache cleared)"):
        print(f"{name:>22}{ms(r[name], 0):>9.1f}{ms(r[name], 1):>11.1f}{len(r[name]):>7}")
    print(f"busy / idle (server time): {ms(r['busy'], 1) / ms(r['idle'], 1):.2f}")
    print(f"generated tokens/s: {r['plain']:.0f} without reloads, {r['with_reloads']:.0f} with a reload "
          f"every ~0.5 s (ratio {r['with_reloads'] / r['plain']:.2f}), {r['clearing']:.0f} with reloads that clear "
          f"the KV cache (ratio {r['clearing'] / r['plain']:.2f}; running requests recompute their prefix)")  # fmt: skip


if __name__ == "__main__":
    main()
