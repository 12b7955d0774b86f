"""LoRA against full fine-tuning on a real-shape model, as ratios measured in one run: optimizer-state
memory, bytes per weight sync, sync time and trainer step time.

    uv run python benchmarks/lora.py [--preset qwen3-0.6b] [--tokens 512] [--steps 3] [--rank 16]

The model is `make-tiny-model --preset qwen3-0.6b` (Qwen3-0.6B's shape: vocabulary 151,936, 28
layers, width 1024, random weights; `--preset real-vocab` for a quick run). Each mode trains in a
process of its own (so memory does not mix), on the same packed micro-batch of `--tokens` tokens:
- full: every weight trained (AdamW);
- lora: rank `--rank` adapters on the 7 linear layers of every block (the default targets).
Per mode: AdamW's state in bytes after a step; the median `Trainer.train_step` time of the steps
after the first; the published step folder's bytes (`Publisher`: the safetensors, config and
tokenizer of full weights, or the adapter) and the seconds from publishing to the server serving
it: `Publisher.publish` until written, then the orchestrator's `WeightSync` having one `uv run
inference` server (started once, with LoRA) load it, through `/prime_rl/load_weights` (pause,
reload, resume) or `/prime_rl/load_adapter`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()


def samples(tokens: int, vocab: int) -> list:
    from prime_rl.transport.messages import TrainingSample

    rng, out, left = random.Random(0), [], tokens
    while left:
        n = min(512, left)
        p = min(64, n - 1)
        out.append(TrainingSample([rng.randrange(3, vocab) for _ in range(p)],
                                  [rng.randrange(3, vocab) for _ in range(n - p)], [1] * (n - p),
                                  [-6.0] * (n - p), rng.uniform(-1, 1), 0.0, "env"))  # fmt: skip
        left -= n
    return out


def train(args) -> None:
    """One mode in this process: steps, optimizer state, one publish; figures to --out as JSON."""
    import torch

    from prime_rl.trainer.config import TrainerConfig
    from prime_rl.trainer.parallel.dist import World
    from prime_rl.trainer.rl.trainer import Trainer
    from prime_rl.trainer.weights.publish import Publisher
    from prime_rl.transport.packing import pack

    lora = {"rank": args.rank, "alpha": 2.0 * args.rank} if args.mode == "lora" else None
    config = TrainerConfig(model={"name": args.model}, lora=lora, seq_len=args.tokens, output_dir=args.run,
                           optim={"lr": 1e-6})  # fmt: skip
    world = World()
    trainer = Trainer(config, world)
    mbs = pack(samples(args.tokens, trainer.model.config.vocab_size), args.tokens, 1, "lora", 0)[0]
    times = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        trainer.train_step(mbs, step)
        times.append(time.perf_counter() - t0)
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    publisher = Publisher(Path(args.run), args.model, world, keep=2, lora=config.lora)
    t0 = time.perf_counter()
    publisher.publish(trainer.model, 1)
    publisher.wait()
    publish_s = time.perf_counter() - t0
    folder = Path(args.run) / "weights" / "step_1"
    figures = {
        "trained_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "optimizer_bytes": sum(t.numel() * t.element_size() for t in state),
        "step_s": statistics.median(times[1:] or times),
        "publish_s": publish_s,
        "sync_bytes": sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
    }
    Path(args.out).write_text(json.dumps(figures))


def run_mode(mode: str, model: Path, run: Path, args) -> dict:
    out = run / "figures.json"
    cmd = [sys.executable, HERE.as_posix(), "--train", mode, "--model", str(model), "--run", str(run),
           "--out", str(out), "--tokens", str(args.tokens), "--steps", str(args.steps), "--rank", str(args.rank)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def start_server(model: Path, runs: Path, rank: int):
    import tomli_w

    from prime_rl.engine.server import wait_until_healthy
    from prime_rl.inference.config import LORA_RANKS
    from prime_rl.runtime.net import free_port

    port = free_port()
    config = runs / "inference.toml"
    max_rank = next(r for r in LORA_RANKS if r >= rank)
    config.write_text(tomli_w.dumps({"lora": {"max_rank": max_rank, "runs_root": str(runs)}}))
    log = (runs / "server.log").open("w")
    cmd = [str(Path(sys.executable).parent / "inference"), "@", str(config), "--model.name", str(model),
           "--model.max-model-len", "512", "--server.port", str(port), "--output-dir", str(runs / "full")]  # fmt: skip
    # A benchmark server on loopback: no secret unless this process has one (benchmarks/auth.py).
    env = {**os.environ, "PRIME_RL_NO_SECRET": os.environ.get("PRIME_RL_NO_SECRET", "1")}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        wait_until_healthy(f"http://127.0.0.1:{port}", timeout_s=900, process=proc)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit("the server did not start:\n" + (runs / "server.log").read_text()[-3000:]) from None
    return proc, f"http://127.0.0.1:{port}/v1"


def load_seconds(url: str, run: Path, adapter: str | None) -> float:
    from prime_rl.orchestrator.config import ClientConfig
    from prime_rl.orchestrator.loop.servers import ServerPool
    from prime_rl.orchestrator.loop.weights import Adapter, WeightSync

    pool = ServerPool(ClientConfig(base_urls=[url]))
    sync = WeightSync(
        run / "weights", pool, timeout_s=900, adapter=Adapter(adapter, str(run)) if adapter else None
    )

    async def load() -> float:
        await sync.claim()
        t0 = time.perf_counter()
        assert await sync.poll() == 1
        return time.perf_counter() - t0

    return asyncio.run(load())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-0.6b", help="make-tiny-model preset")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--train", choices=["full", "lora"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--run", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.train:
        args.mode = args.train
        return train(args)

    from prime_rl.model.tiny import TinyModelConfig, make_tiny_model

    runs = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    model = make_tiny_model(TinyModelConfig(output=runs / "model", preset=args.preset))
    figures = {mode: run_mode(mode, model, runs / mode, args) for mode in ("full", "lora")}
    proc, url = start_server(model, runs, args.rank)  # full weights load from its own run folder, runs/full
    try:
        for mode in ("full", "lora"):
            figures[mode]["load_s"] = load_seconds(url, runs / mode, "bench" if mode == "lora" else None)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    for f in figures.values():
        f["sync_s"] = f["publish_s"] + f["load_s"]
    full, lora = figures["full"], figures["lora"]
    print(
        f"{args.preset} model, {args.tokens}-token micro-batch, LoRA rank {args.rank} on every block's 7 linear layers"
    )
    print(f"{'':>22}{'full':>14}{'lora':>14}{'lora / full':>13}")
    rows = [("trained parameters", "trained_params", "{:,.0f}"), ("optimizer state (MB)", "optimizer_bytes", "{:,.1f}"),
            ("bytes per sync (MB)", "sync_bytes", "{:,.2f}"), ("publish (s)", "publish_s", "{:.3f}"),
            ("server load (s)", "load_s", "{:.3f}"), ("sync time (s)", "sync_s", "{:.3f}"),
            ("trainer step (s)", "step_s", "{:.3f}")]  # fmt: skip
    for label, key, fmt in rows:
        scale = 1e6 if key.endswith("bytes") else 1
        print(f"{label:>22}{fmt.format(full[key] / scale):>14}{fmt.format(lora[key] / scale):>14}"
              f"{lora[key] / full[key]:>13.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
