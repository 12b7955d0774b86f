"""Trainer efficiency: tokens/s of the trainer's step against a bare transformers loop.

    uv run python benchmarks/trainer.py [--hidden 256 --layers 4 --seq-len 2048 --micro-batches 8]
    uv run python benchmarks/trainer.py --preset real-vocab --micro-batches 1 --rounds 3 --sizes ''

All train the same freshly built model (make-tiny-model at the given size, or a `--preset`) on the
same packed micro-batches: the trainer through `Trainer.train_step` (validation, per-token loss with
ratio and masks, global token normalization, metrics, clipping, AdamW), with its chunked logprobs on
the positions that predict a loss token, once more with the chunked logprobs on every position (the
path before), and once with the full-logits logprobs it used before that (`full_logits_logprobs`:
the model's whole [tokens x vocab] logits, then log_softmax); the bare loop through one forward (the
model's logits at every position, as transformers computes them), a policy-gradient loss and
backward per micro-batch, then clipping and AdamW. Rounds alternate between the four, so machine
noise hits all; the ratios of their median tokens/s are printed.

Then micro-batch sizes (`--sizes`, default 512, 2k, 8k, 32k): the trainer's tokens/s on steps of
`--step-tokens` tokens packed into micro-batches of each size, from short samples (~40 tokens, 20-60)
and long ones (~2k, 1.5k-2k), with each attention of `--attention` (packed: today's default; dense:
transformers' [T, T] mask, the path before). Printed: tokens/s, the ratio to the same attention at
the smallest size, and packed / dense. Dense is skipped above `--dense-max` tokens (its mask and
scores grow with T²).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from prime_rl.model.tiny import TinyModelConfig, make_tiny_model
from prime_rl.trainer.batch import PackedBatch
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.logprobs import _position_logprobs, full_logits_logprobs
from prime_rl.trainer.memory import keep_freed_memory
from prime_rl.trainer.parallel.dist import init_world
from prime_rl.trainer.rl.trainer import Trainer
from prime_rl.transport.messages import TrainingSample
from prime_rl.transport.packing import pack


def micro_batches(seq_len: int, count: int, vocab: int):
    rng = random.Random(0)
    samples = []
    while sum(len(s) for s in samples) < seq_len * count * 0.97:
        p, c = rng.randint(30, 200), rng.randint(20, 400)
        samples.append(TrainingSample([rng.randrange(3, vocab) for _ in range(p)], [rng.randrange(3, vocab) for _ in range(c)],
                                      [1] * c, [-6.0] * c, rng.uniform(-1, 1), 0.0, "env"))  # fmt: skip
    return pack(samples, seq_len, 1, "bench", 0)[0]


def sized_samples(kind: str, tokens: int, vocab: int, seed: int = 0) -> list[TrainingSample]:
    """Samples of `kind` ('short' ~40 tokens, 'long' ~2k) adding up to about `tokens`."""
    rng = random.Random(seed)
    low, high = (20, 60) if kind == "short" else (1536, 2048)
    out, total = [], 0
    while total < tokens:
        n = min(rng.randint(low, high), max(2, tokens - total))
        p = max(1, n // 2)
        out.append(TrainingSample([rng.randrange(3, vocab) for _ in range(p)], [rng.randrange(3, vocab) for _ in range(n - p)],
                                  [1] * (n - p), [-6.0] * (n - p), rng.uniform(-1, 1), 0.0, "env"))  # fmt: skip
        total += n
    return out


def size_sweep(folder: Path, args) -> None:
    """tokens/s of the trainer per micro-batch size, sample kind and attention mechanism."""
    sizes = [int(x) for x in args.sizes.split(",")]
    mechanisms = args.attention.split(",")
    trainers = {
        m: Trainer(
            TrainerConfig(
                model={"name": str(folder), "attention": m},
                seq_len=max(sizes),
                output_dir=str(folder.parent / f"out-{m}"),
            ),
            init_world(),
        )
        for m in mechanisms
    }
    rates: dict[tuple[str, int, str], float] = {}
    for kind in ("short", "long"):
        samples = sized_samples(kind, args.step_tokens, 500)
        for size in sizes:
            if kind == "long" and size < 2048:
                continue
            mbs = pack(samples, size, 1, "bench", 0)[0]
            tokens = sum(mb.num_tokens for mb in mbs)
            runs = [m for m in mechanisms if m != "dense" or size <= args.dense_max]
            for m in runs:
                trainers[m].train_step(mbs)  # warm-up
            got: dict[str, list[float]] = {m: [] for m in runs}
            for _ in range(args.size_rounds):  # alternating, so noise hits all
                for m in runs:
                    t0 = time.perf_counter()
                    trainers[m].train_step(mbs)
                    got[m].append(tokens / (time.perf_counter() - t0))
            for m in runs:
                rates[kind, size, m] = statistics.median(got[m])
                print(
                    f"  {kind} {size} {m}: {rates[kind, size, m]:.0f} tokens/s", file=sys.stderr, flush=True
                )
    print(
        f"\nmicro-batch sizes: steps of ~{args.step_tokens} tokens, {args.size_rounds} rounds, median tokens/s"
    )
    print("| samples | micro-batch | attention | tokens/s | vs smallest size | packed / dense |")
    print("|---|---|---|---|---|---|")
    for kind, size, m in sorted(rates, key=lambda k: (k[0] == "long", k[1], k[2] != "packed")):
        first = min(s for k, s, mm in rates if k == kind and mm == m)
        vs = rates[kind, size, m] / rates[kind, first, m]
        dense = rates.get((kind, size, "dense"))
        pd = (
            f"{rates[kind, size, 'packed'] / dense:.2f}"
            if m == "packed" and dense and (kind, size, "packed") in rates
            else ""
        )
        print(f"| {kind} | {size} | {m} | {rates[kind, size, m]:.0f} | {vs:.2f} | {pd} |")


def bare_step(model, optimizer, tensors) -> None:
    tokens = sum(int(t["loss_mask"].sum()) for t in tensors)
    for t in tensors:
        ids, pos = t["input_ids"], t["position_ids"]
        logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0, :-1].float()
        logp = F.log_softmax(logits, -1).gather(-1, ids[1:, None]).squeeze(-1)
        loss = -(logp * t["rollout_advantages"][1:] * t["loss_mask"][1:]).sum() / tokens
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default=None, help="a make-tiny-model preset instead of --hidden/--layers")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="512,2048,8192,32768", help="micro-batch sizes to sweep ('' skips)")
    ap.add_argument("--step-tokens", type=int, default=32768)
    ap.add_argument("--size-rounds", type=int, default=3)
    ap.add_argument("--attention", default="packed,dense")
    ap.add_argument("--dense-max", type=int, default=8192)
    ap.add_argument("--skip-bare", action="store_true", help="only the size sweep")
    args = ap.parse_args()

    keep_freed_memory(init_world())  # as the trainer process does
    folder = Path(tempfile.mkdtemp()) / "model"
    if args.preset:
        make_tiny_model(TinyModelConfig(output=folder, preset=args.preset))
    else:
        make_tiny_model(TinyModelConfig(output=folder, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                        num_layers=args.layers))  # fmt: skip
    if not args.skip_bare:
        compare_bare(folder, args)
    if args.sizes:
        size_sweep(folder, args)


def compare_bare(folder: Path, args) -> None:
    mbs = micro_batches(args.seq_len, args.micro_batches, 500)
    num_tokens = sum(mb.num_tokens for mb in mbs)
    config = TrainerConfig(
        model={"name": str(folder)}, seq_len=args.seq_len, output_dir=str(folder.parent / "out")
    )
    trainer = Trainer(config, init_world())
    every = Trainer(config, init_world())
    full = Trainer(config, init_world())
    # The paths before, on the same code otherwise: the head on every position, then the full logits.
    every.model.prime_rl_position_logprobs = lambda ids, pos, targets, temperature=1.0, chunk_tokens=None, rows=None, **kw: (
        _position_logprobs(every.model, ids, pos, targets, temperature, chunk_tokens, None, **kw)
    )  # fmt: skip
    full.model.prime_rl_position_logprobs = lambda ids, pos, targets, temperature=1.0, chunk_tokens=0, rows=None, **kw: (
        full_logits_logprobs(full.model, ids, pos, targets, temperature, **kw)
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    tensors = []
    for mb in mbs:
        b = PackedBatch.of(mb, trainer.world)
        tensors.append({"input_ids": b.input_ids, "position_ids": b.position_ids, "loss_mask": b.loss_mask.float(),
                        "rollout_advantages": b.per_token(b.rollout_advantages)})  # fmt: skip

    loss_tokens = sum(int(t["loss_mask"].sum()) for t in tensors)
    sides = {"ours": trainer.train_step, "every": every.train_step, "full": full.train_step,
             "bare": lambda _: bare_step(model, optimizer, tensors)}  # fmt: skip
    rates: dict[str, list[float]] = {name: [] for name in sides}
    for step in sides.values():
        step(mbs)  # warm-up
    for _ in range(args.rounds):
        for name, step in sides.items():
            t0 = time.perf_counter()
            step(mbs)
            rates[name].append(num_tokens / (time.perf_counter() - t0))
    ours, every_row, before, bare = (statistics.median(rates[n]) for n in sides)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model {params:.1f}M params, {len(mbs)} micro-batches, {num_tokens} tokens per step "
          f"({loss_tokens} in the loss), {torch.get_num_threads()} threads, {args.rounds} rounds")  # fmt: skip
    print(f"trainer tokens/s (median)                     {ours:.0f}")
    print(f"trainer, head on every position tokens/s      {every_row:.0f}")
    print(f"trainer, full logits tokens/s                 {before:.0f}")
    print(f"bare    tokens/s (median)                     {bare:.0f}")
    print(f"ratio trainer / bare                          {ours / bare:.3f}")
    print(f"ratio trainer / head on every position        {ours / every_row:.3f}")
    print(f"ratio trainer / full-logits trainer           {ours / before:.3f}")


if __name__ == "__main__":
    main()
