"""Trainer memory at a real vocabulary: a trainer step's peak against a bare forward and backward of
the model body, and the longest micro-batch that fits one memory budget at cp = 1 and cp = 2.

    uv run python benchmarks/memory.py [--tokens 2048 4096 8192] [--budget-gb B] [--ac] [--preset P] [--plan]
    uv run python benchmarks/memory.py --attention [--tokens 8192 16384 32768 65536] [--cps 1 2 4]

The model is `make-tiny-model --preset real-vocab` (Qwen3's vocabulary of 151,936, width 256, 2
layers, random weights), or another preset (`qwen3-0.6b`: Qwen3-0.6B's shape; `--no-search` then
saves the long bisection). Every measurement runs in a fresh process, so peaks do not mix, with glibc
told to hand freed memory back (MALLOC_MMAP_THRESHOLD_), and reads how far the peak RSS (VmHWM, reset
through /proc/self/clear_refs) rose above the RSS before the measured step:
- body: forward and backward of the model's body (embeddings, decoder layers, final norm; loss = mean
  square of the last hidden states), its gradients allocated, as a bare training loop would;
- trainer: `Trainer.train_step` on one packed micro-batch (validation, chunked logprobs, loss,
  metrics, clipping, AdamW), its second step, when the optimizer state exists, as in a long run;
- cp = 2: the same trainer step on two gloo ranks under torchrun; the larger rank's peak counts.
`--plan` adds `plan-memory`'s prediction of "trainer in all" (a fake dry run of the same step on
the CPU, no data) and its ratio to the measurement; `--no-body` skips the body probe.
"trainer in all" is a rank's peak above the bare interpreter (torch and transformers imported): its
share of the parameters, optimizer state and gradients, plus the step's own memory; with several
ranks FSDP shards the first three, and gathers each unit's parameters while it computes. The
longest micro-batch that fits is bisected in steps of 512 tokens against that per-rank figure
(budget default: what the trainer at cp = 1 needs in all for the middle --tokens length), once at
cp = 1 and once at cp = 2.

`--attention`: attention memory per rank under context parallelism. Each cp rank (real torchrun
ranks, gloo) runs one attention layer, forward and backward, over its shard of a micro-batch of ~2k
token samples, with the all-to-all of the keys it needs: Qwen3-0.6B's attention shape (16 query
heads, 8 key/value heads of 128), float32. Reported: the larger rank's peak RSS growth over its
inputs (q, k, v), against cp = 1 at the same tokens per rank, and the [L, cp * L] mask the path
before this one built (its scores came on top).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
STEP = 512


def status(key: str) -> float:
    """A /proc/self/status figure in GB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key)) / 2**20


def measure(fn) -> tuple[float, float, float]:
    """(peak RSS growth in GB, peak RSS in GB, seconds) of one call."""
    gc.collect()
    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak restarts from the current RSS
    t0 = time.perf_counter()
    fn()
    return status("VmHWM") - before, status("VmHWM"), time.perf_counter() - t0


def samples(tokens: int, vocab: int) -> list:
    """Samples of at most 2,048 tokens (128 prompt tokens each) filling `tokens` exactly."""
    from prime_rl.transport.messages import TrainingSample

    rng, out, left = random.Random(0), [], tokens
    while left:
        n = min(2048, left)
        p = min(128, n - 1)
        out.append(TrainingSample([rng.randrange(3, vocab) for _ in range(p)],
                                  [rng.randrange(3, vocab) for _ in range(n - p)], [1] * (n - p),
                                  [-6.0] * (n - p), rng.uniform(-1, 1), 0.0, "env"))  # fmt: skip
        left -= n
    return out


def probe(args) -> None:
    """One measurement in this process (a torchrun rank for cp > 1); writes {"gb", "s"} to --out."""
    from prime_rl.trainer.batch import PackedBatch
    from prime_rl.trainer.config import TrainerConfig
    from prime_rl.trainer.parallel.dist import close_world, exit_rank, init_world
    from prime_rl.trainer.rl.trainer import Trainer
    from prime_rl.transport.packing import pack

    world = init_world(args.cp)
    base = status("VmRSS")  # the interpreter, torch and transformers, before any model
    config = TrainerConfig(model={"name": args.model, "activation_checkpointing": args.ac}, seq_len=args.tokens,
                           parallel={"cp": args.cp}, output_dir=tempfile.mkdtemp())  # fmt: skip
    trainer = Trainer(config, world)
    vocab = trainer.model.config.vocab_size
    mbs = pack(samples(args.tokens, vocab), args.tokens, 1, "mem", 0)[0]
    if args.probe == "body":
        b = PackedBatch.of(mbs[0], world)
        body = trainer.model.base_model

        def step():
            h = body(input_ids=b.input_ids[None], position_ids=b.position_ids[None], use_cache=False)
            h.last_hidden_state.float().pow(2).mean().backward()
            trainer.model.zero_grad(set_to_none=True)

        step()
    else:

        def step():
            trainer.train_step(mbs)

        step()  # the optimizer state now exists
    gb, peak, s = measure(step)
    Path(f"{args.out}.{world.rank}").write_text(json.dumps({"gb": gb, "rank_gb": peak - base, "s": s}))
    close_world(world)
    exit_rank(world, 0)


HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128


def attention_probe(args) -> None:
    """One rank's attention layer over its shard; writes {"gb", "rank_gb", "s"} to --out.<rank>."""
    import torch

    from prime_rl.trainer.attention import packed_attention
    from prime_rl.trainer.parallel.context_parallel import shard_micro_batch
    from prime_rl.trainer.parallel.dist import close_world, exit_rank, init_world

    world = init_world(args.cp)
    base = status("VmRSS")
    # ~2k tokens (1.5k-2.5k), so samples cross the ranks' chunk borders and keys are exchanged.
    rng, lens = random.Random(0), []
    while sum(lens) < args.tokens:
        lens.append(min(rng.randint(1536, 2560), args.tokens - sum(lens)))
    shard = shard_micro_batch(lens, world.cp, world.cp_rank, world.cp_group, torch.device("cpu"))
    rows = shard.attention.length
    g = torch.Generator().manual_seed(world.rank)
    q, k, v = (
        torch.randn(1, h, rows, HEAD_DIM, generator=g, requires_grad=True)
        for h in (HEADS, KV_HEADS, KV_HEADS)
    )

    def step():
        out, _ = packed_attention(None, q, k, v, position_ids=None, packed_attention=shard.attention)
        out.square().mean().backward()
        q.grad = k.grad = v.grad = None

    step()
    gb, peak, s = measure(step)
    Path(f"{args.out}.{world.rank}").write_text(json.dumps({"gb": gb, "rank_gb": peak - base, "s": s}))
    close_world(world)
    exit_rank(world, 0)


def attention_sweep(args) -> None:
    print("attention memory per rank: one layer's forward + backward over a rank's shard "
          f"({HEADS} query / {KV_HEADS} key-value heads of {HEAD_DIM}, float32, samples of 1.5k-2.5k tokens)")  # fmt: skip
    print("| tokens | cp | tokens per rank | peak growth, larger rank | vs cp = 1 at the same tokens per rank "
          "| the [L, cp L] mask before | seconds |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    at_cp1 = {}
    for cp in args.cps:
        for n in args.tokens:
            r = run_probe(None, "attention", n, cp)
            per_rank = -(-n // cp)
            if cp == 1:
                at_cp1[n] = r["gb"]
            ref = at_cp1.get(per_rank)
            vs = f"{r['gb'] / ref:.2f}" if ref else ""
            mask = per_rank * n / 2**30 if cp > 1 else 0.0
            print(
                f"| {n} | {cp} | {per_rank} | {r['gb']:.3f} GB | {vs} | {mask:.2f} GB | {r['s']:.1f} |",
                flush=True,
            )


def run_probe(model: Path, kind: str, tokens: int, cp: int = 1, ac: bool = False) -> dict:
    out = Path(tempfile.mkdtemp()) / "probe"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": str(max(1, 2 // cp))}
    cmd = [HERE.as_posix(), "--probe", kind, "--tokens", str(tokens), "--cp", str(cp),
           "--out", str(out)] + (["--ac"] if ac else []) + (["--model", str(model)] if model else [])  # fmt: skip
    if cp > 1:
        from prime_rl.runtime.net import free_port

        cmd = ["-m", "torch.distributed.run", "--nproc-per-node", str(cp), "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), *cmd]  # fmt: skip
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"probe {kind} {tokens} cp={cp} failed:\n{proc.stderr[-3000:]}")
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(cp)]
    return {k: max(r[k] for r in ranks) for k in ("gb", "rank_gb", "s")}


def plan(model: Path, tokens: int, ac: bool) -> float:
    """plan-memory's predicted peak (GiB, as the probes report) of the probe's trainer step on the CPU."""
    cmd = [sys.executable, "-m", "prime_rl.trainer.gpu.plan_memory", "--model", str(model), "--seq-len", str(tokens),
           "--dtype", "float32", "--device", "cpu", "--no-search", "--json"] + (["--ac"] if ac else [])  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_bytes"]["total"] / 2**30


def longest(model: Path, cp: int, budget: float, lo: int, hi: int) -> int:
    """The longest micro-batch (a multiple of STEP in [lo, hi]) whose trainer step keeps each rank's
    memory (model, optimizer state, gradients, activations) within budget."""
    if run_probe(model, "trainer", lo, cp)["rank_gb"] > budget:
        return 0
    while hi - lo > STEP:
        mid = (lo + hi) // 2 // STEP * STEP
        if run_probe(model, "trainer", mid, cp)["rank_gb"] <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--probe", choices=["body", "trainer", "attention"])
    ap.add_argument("--attention", action="store_true", help="attention memory per rank at --cps")
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--model")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--ac", action="store_true", help="activation checkpointing in the trainer")
    ap.add_argument("--out")
    ap.add_argument("--budget-gb", type=float, default=None)
    ap.add_argument(
        "--search-hi", type=int, default=None, help="upper end of the search (default 3x the middle length)"
    )
    ap.add_argument("--preset", default="real-vocab", help="make-tiny-model preset")
    ap.add_argument("--no-search", action="store_true", help="skip the longest-micro-batch search")
    ap.add_argument("--plan", action="store_true", help="compare with plan-memory's prediction")
    ap.add_argument("--no-body", action="store_true", help="skip the bare forward/backward probe")
    args = ap.parse_args()
    if args.probe:
        args.tokens = args.tokens[0]
        return attention_probe(args) if args.probe == "attention" else probe(args)
    if args.attention:
        if args.tokens == ap.get_default("tokens"):
            args.tokens = [8192, 16384, 32768, 65536]
        return attention_sweep(args)

    from prime_rl.model.tiny import TinyModelConfig, make_tiny_model

    model = make_tiny_model(TinyModelConfig(output=Path(tempfile.mkdtemp()) / "model", preset=args.preset))
    print(f"{args.preset} model, one packed micro-batch, peak RSS growth of one step"
          f"{' (activation checkpointing)' if args.ac else ''}")  # fmt: skip
    print(
        f"{'tokens':>7} | {'body':>8} | {'trainer':>8} | ratio | {'body s':>7} | {'trainer s':>9} | trainer in all"
        + (" | planned | planned / measured" if args.plan else "")
    )
    rows = {}
    for n in args.tokens:
        nan = {"gb": float("nan"), "s": float("nan")}
        body = nan if args.no_body else run_probe(model, "body", n)
        trainer = run_probe(model, "trainer", n, ac=args.ac)
        rows[n] = (body, trainer)
        line = (f"{n:>7} | {body['gb']:>6.2f}GB | {trainer['gb']:>6.2f}GB | {trainer['gb'] / body['gb']:>5.2f} | "
                f"{body['s']:>7.1f} | {trainer['s']:>9.1f} | {trainer['rank_gb']:>6.2f}GB")  # fmt: skip
        if args.plan:
            planned = plan(model, n, args.ac)
            line += f" | {planned:>5.2f}GB | {planned / trainer['rank_gb']:.3f}"
        print(line, flush=True)
    if args.no_body:
        return
    ns = sorted(rows)
    if len(ns) >= 2:
        a, b = ns[-2], ns[-1]
        growth = (rows[b][1]["gb"] - rows[a][1]["gb"]) / max(rows[b][0]["gb"] - rows[a][0]["gb"], 1e-9)
        print(f"growth {a} -> {b} tokens: trainer / body = {growth:.2f} (target <= 2)")
    middle = ns[len(ns) // 2]
    print(
        f"trainer / body at {middle} tokens = {rows[middle][1]['gb'] / rows[middle][0]['gb']:.2f} (target <= 3)"
    )
    if args.no_search:
        return
    budget = args.budget_gb or rows[middle][1]["rank_gb"]
    hi = args.search_hi or 3 * middle
    fit1 = longest(model, 1, budget, middle // 2, hi)
    fit2 = longest(model, 2, budget, middle // 2, hi)
    print(f"longest micro-batch within {budget:.2f} GB per rank: cp=1 {fit1} tokens, cp=2 {fit2} tokens "
          f"= {fit2 / max(fit1, 1):.2f}x (target >= 1.8; search up to {hi})")  # fmt: skip


if __name__ == "__main__":
    main()
