"""Weight sync: publish-to-serving latency per step, against writing plus reading the same safetensors.

    uv run python benchmarks/weight_sync.py [--hidden 384 --layers 6 --steps 5]

Starts `inference` on a freshly built model, then for each step: the trainer's Publisher writes the
weights (gather, safetensors, config, tokenizer, READY) and the orchestrator's WeightSync finds the
new step and has the server load it (pause, reload in place, resume). The baseline writes and reads
the same state dict with safetensors alone. Medians over the steps, and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from prime_rl.inference.server import wait_until_healthy
from prime_rl.model.tiny import TinyModelConfig, make_tiny_model
from prime_rl.net import free_port
from prime_rl.orchestrator.client import ServerPool
from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.weights import WeightSync
from prime_rl.trainer.dist import init_world
from prime_rl.trainer.publish import Publisher


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    folder = make_tiny_model(TinyModelConfig(output=tmp / "model", hidden_size=args.hidden,
                                             intermediate_size=3 * args.hidden, num_layers=args.layers))  # fmt: skip
    port, out = free_port(), tmp / "run"
    cmd = [str(Path(sys.executable).parent / "inference"), "--model.name", str(folder), "--model.max-model-len", "256",
           "--server.port", str(port), "--output-dir", str(out)]  # fmt: skip
    log = (tmp / "inference.log").open("w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(base, timeout_s=600, process=server)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        publisher = Publisher(out, str(folder), init_world(), keep=2)
        sync = WeightSync(out / "weights", ServerPool(ClientConfig(base_urls=[f"{base}/v1"])))
        latency, published, baseline = [], [], []
        for step in range(1, args.steps + 1):
            with torch.no_grad():
                model.lm_head.weight.mul_(1.01)  # new weights each step
            t0 = time.perf_counter()
            publisher.publish(model, step)
            publisher.wait()
            published.append(time.perf_counter() - t0)
            assert asyncio.run(sync.poll()) == step
            latency.append(time.perf_counter() - t0)

            state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            t0 = time.perf_counter()
            save_file(state, str(tmp / "plain.safetensors"))
            load_file(str(tmp / "plain.safetensors"))
            baseline.append(time.perf_counter() - t0)
        publisher.close()
        size = (tmp / "plain.safetensors").stat().st_size / 2**20
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"model {params:.1f}M params ({size:.0f} MB float32), {args.steps} steps")
        print(f"publish -> serving (median) {1e3 * statistics.median(latency):.0f} ms")
        print(f"  of which publishing       {1e3 * statistics.median(published):.0f} ms")
        print(
            f"  of which loading (server) {1e3 * (statistics.median(latency) - statistics.median(published)):.0f} ms"
        )
        print(f"safetensors write + read    {1e3 * statistics.median(baseline):.0f} ms")
        print(f"ratio                       {statistics.median(latency) / statistics.median(baseline):.2f}")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
