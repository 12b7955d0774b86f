"""Weight sync: publish-to-serving latency per step, files against the in-memory broadcast, and
against the limits (writing plus reading the same safetensors; one memory copy of the weights).

    uv run python benchmarks/weight_sync.py [--hidden 512 --layers 16 --steps 5]

Starts `inference` on a freshly built model (default 54M parameters), then per step, alternating
the two modes on the same server:
- filesystem: the trainer's Publisher writes the weights (gather, safetensors, config, tokenizer,
  READY) and the orchestrator's WeightSync has the server load the folder (pause, reload, resume);
- collective: the Publisher broadcasts them to the server's worker over a gloo group (pause, load
  as the chunks arrive, resume), writes the markers, and WeightSync sees the server serve the step.
Then the server is stopped and the same model is served by vLLM's engine in a process of its own, as
the orchestrator holds it in engine mode (`deployment.inference_mode = "engine"`):
- engine: the Publisher writes the folder, and the engine's process loads it by one call between
  two engine steps (`LocalEngine.load_weights`), told and answered over a pipe.
Limits, measured in the same run: safetensors write + read, one memory copy of the weights (into
tensors already allocated), and the same chunks over a bare gloo group to a process that only
receives them. Medians over the steps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from prime_rl.engine.server import wait_until_healthy
from prime_rl.model.tiny import TinyModelConfig, make_tiny_model
from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.loop.servers import ServerPool
from prime_rl.orchestrator.loop.weights import WeightSync
from prime_rl.runtime.net import free_port
from prime_rl.trainer.config import WeightBroadcastConfig
from prime_rl.trainer.parallel.dist import init_world
from prime_rl.trainer.weights.broadcast import Broadcaster
from prime_rl.trainer.weights.publish import Publisher
from prime_rl.transport.weight_transfer import (
    join_group,
    make_plan,
    open_store,
    plan_from_json,
    plan_to_json,
    receive,
    send,
)


def _receive_only(port: int, plan_json: list, rounds: int) -> None:
    store = open_store("127.0.0.1", port, is_master=False, timeout_s=120)
    for r in range(rounds):
        group = join_group(store, f"raw/{r}/", 1, 2, 120, cuda=False)
        for _ in receive(group, plan_from_json(plan_json), torch.device("cpu")):
            pass


def raw_gloo(state: dict[str, torch.Tensor], chunk_mb: float, rounds: int) -> list[float]:
    """The same chunks over a bare gloo group to a process that only receives them: the wire's limit."""
    import multiprocessing

    port = free_port()
    plan = make_plan(state, int(chunk_mb * 2**20))
    store = open_store("127.0.0.1", port, is_master=True, timeout_s=120)
    peer = multiprocessing.get_context("spawn").Process(
        target=_receive_only, args=(port, plan_to_json(plan), rounds)
    )
    peer.start()
    times = []
    for r in range(rounds):
        group = join_group(store, f"raw/{r}/", 0, 2, 120, cuda=False)
        t0 = time.perf_counter()
        send(group, state, plan, torch.device("cpu"))
        times.append(time.perf_counter() - t0)
    peer.join(timeout=120)
    return times


ENGINE = """
import asyncio, sys
from pathlib import Path
from prime_rl.inference.config import InferenceConfig
from prime_rl.engine.local import LocalEngine

async def main():
    config = InferenceConfig(model={"name": sys.argv[1], "max_model_len": 256}, output_dir=sys.argv[2])
    engine = await LocalEngine(config).start()
    print("ready", flush=True)
    for line in sys.stdin:
        path, step = line.split()
        reload = await engine.load_weights(Path(path), int(step))
        print(f"served {reload.step} {reload.seconds}", flush=True)
    engine.close()

asyncio.run(main())
"""
"""vLLM's engine in a process of its own (as in the orchestrator): loads `<folder> <step>` lines."""


def engine_latency(folder: Path, out: Path, publisher: Publisher, model, first: int, steps: int):
    """Publish -> served by the engine in another process, per step; and the load alone."""
    engine = subprocess.Popen([sys.executable, "-c", ENGINE, str(folder), str(out / "engine")], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)  # fmt: skip
    latency, loads = [], []

    def said(word: str) -> list[str]:  # vLLM logs to the same stdout: skip its lines
        for line in engine.stdout:
            if line.startswith(word):
                return line.split()
        raise RuntimeError(f"the engine's process ended before saying {word!r}")

    try:
        said("ready")
        for step in range(first, first + steps):
            with torch.no_grad():
                model.lm_head.weight.mul_(1.01)
            t0 = time.perf_counter()
            publisher.publish(model, step)
            publisher.wait()
            engine.stdin.write(f"{(out / 'weights' / f'step_{step}').resolve()} {step}\n")
            engine.stdin.flush()
            _, served, seconds = said("served")
            assert int(served) == step
            latency.append(time.perf_counter() - t0)
            loads.append(float(seconds))
        engine.stdin.close()
        engine.wait(timeout=120)
    finally:
        if engine.poll() is None:
            os.killpg(engine.pid, signal.SIGKILL)
    return latency, loads


def ms(values: list[float]) -> str:
    return f"{1e3 * statistics.median(values):7.0f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    folder = make_tiny_model(TinyModelConfig(output=tmp / "model", hidden_size=args.hidden, num_heads=args.heads,
                                             num_kv_heads=args.heads // 2, intermediate_size=3 * args.hidden,
                                             num_layers=args.layers))  # fmt: skip
    port, out = free_port(), tmp / "run"
    cmd = [str(Path(sys.executable).parent / "inference"), "--model.name", str(folder), "--model.max-model-len", "256",
           "--server.port", str(port), "--output-dir", str(out)]  # fmt: skip
    log = (tmp / "inference.log").open("w")
    # A benchmark server on loopback: no secret, as the in-process trainer side has none.
    env = {**os.environ, "PRIME_RL_NO_SECRET": os.environ.get("PRIME_RL_NO_SECRET", "1")}
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(base, timeout_s=900, process=server)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        world = init_world()
        broadcaster = Broadcaster(WeightBroadcastConfig(type="collective", servers=[base], port=free_port()))
        publishers = {"filesystem": Publisher(out, str(folder), world, keep=2),
                      "collective": Publisher(out, str(folder), world, keep=2, broadcaster=broadcaster)}  # fmt: skip
        sync = WeightSync(out / "weights", ServerPool(ClientConfig(base_urls=[f"{base}/v1"])))
        latency = {m: [] for m in publishers}
        published = {m: [] for m in publishers}
        baseline, memcpy = [], []
        held = None
        phases: dict[str, list[float]] = {}
        step = 0
        for _ in range(args.steps):
            for mode, publisher in publishers.items():
                step += 1
                with torch.no_grad():
                    model.lm_head.weight.mul_(1.01)  # new weights each step
                t0 = time.perf_counter()
                publisher.publish(model, step)
                publisher.wait()
                published[mode].append(time.perf_counter() - t0)
                assert asyncio.run(sync.poll()) == step
                assert publisher.last_broadcast in (None, 1.0), "the broadcast fell back to files"
                latency[mode].append(time.perf_counter() - t0)
                if mode == "collective":
                    marker = json.loads((out / "weights" / f"step_{step}" / "BROADCAST").read_text())
                    for phase, seconds in marker["phases"].items():
                        phases.setdefault(phase, []).append(seconds)

            state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            t0 = time.perf_counter()
            save_file(state, str(tmp / "plain.safetensors"))
            load_file(str(tmp / "plain.safetensors"))
            baseline.append(time.perf_counter() - t0)
            # Into memory already mapped: a clone's fresh pages cost 1x to 6x a copy, by the allocator's
            # history, and the limit is the copy.
            if held is None:
                held = {k: torch.empty_like(v) for k, v in state.items()}
            t0 = time.perf_counter()
            for k, v in state.items():
                held[k].copy_(v)
            memcpy.append(time.perf_counter() - t0)
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        engine, engine_load = engine_latency(
            folder, out, publishers["filesystem"], model, step + 1, args.steps
        )
        for publisher in publishers.values():
            publisher.close()
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        wire = raw_gloo(state, broadcaster.config.chunk_mb, args.steps)
        size = (tmp / "plain.safetensors").stat().st_size / 2**20
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"model {params:.1f}M params ({size:.0f} MB float32), {args.steps} steps per mode, medians")
        for mode in publishers:
            load = statistics.median(latency[mode]) - statistics.median(published[mode])
            print(f"{mode:10s} publish -> serving {ms(latency[mode])}  (publishing {ms(published[mode])}, "
                  f"then {1e3 * load:.0f} ms until served)")  # fmt: skip
        print(f"{'engine':10s} publish -> serving {ms(engine)}  (the load alone {ms(engine_load)})")
        print(
            "  collective phases: "
            + ", ".join(f"{k} {1e3 * statistics.median(v):.0f} ms" for k, v in phases.items())
        )
        print(f"safetensors write + read      {ms(baseline)}")
        print(f"memory copy of the weights    {ms(memcpy)}")
        print(f"bare gloo broadcast (no load) {ms(wire)}")
        fs, coll = statistics.median(latency["filesystem"]), statistics.median(latency["collective"])
        print(f"collective / filesystem       {coll / fs:.2f}")
        print(f"filesystem / safetensors      {fs / statistics.median(baseline):.2f}")
        print(f"collective / memory copy      {coll / statistics.median(memcpy):.1f}")
        print(f"engine / memory copy          {statistics.median(engine) / statistics.median(memcpy):.1f}")
        print(
            f"collective send / bare gloo   {statistics.median(phases['send']) / statistics.median(wire):.2f}"
        )
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=60)


if __name__ == "__main__":
    main()
