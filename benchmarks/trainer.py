"""Trainer efficiency: tokens/s of the trainer's step against a bare transformers loop.

    uv run python benchmarks/trainer.py [--hidden 256 --layers 4 --seq-len 2048 --micro-batches 8]

All train the same freshly built model (make-tiny-model at the given size) on the same packed
micro-batches: the trainer through `Trainer.train_step` (validation, per-token loss with ratio and
masks, global token normalization, metrics, clipping, AdamW), with its chunked logprobs and once more
with the full-logits logprobs it used before (`full_logits_logprobs`: the model's whole [tokens x
vocab] logits, then log_softmax); the bare loop through one forward, a policy-gradient loss and
backward per micro-batch, then clipping and AdamW. Rounds alternate between the three, so machine
noise hits all; the ratios of their median tokens/s are printed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from prime_rl.model.tiny import TinyModelConfig, make_tiny_model
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.logprobs import full_logits_logprobs
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
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    folder = Path(tempfile.mkdtemp()) / "model"
    make_tiny_model(TinyModelConfig(output=folder, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                                    num_layers=args.layers))  # fmt: skip
    mbs = micro_batches(args.seq_len, args.micro_batches, 500)
    num_tokens = sum(mb.num_tokens for mb in mbs)
    config = TrainerConfig(
        model={"name": str(folder)}, seq_len=args.seq_len, output_dir=str(folder.parent / "out")
    )
    trainer = Trainer(config, init_world())
    full = Trainer(config, init_world())
    # The path before chunking, on the same code otherwise.
    full.model.prime_rl_position_logprobs = lambda ids, pos, targets, temperature=1.0, chunk_tokens=0, **kw: (
        full_logits_logprobs(full.model, ids, pos, targets, temperature, **kw)
    )
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    tensors = [trainer._tensors(mb) for mb in mbs]
    tensors = [{**t, "loss_mask": t["loss_mask"].float()} for t in tensors]

    trainer.train_step(mbs)  # warm-up, all sides
    full.train_step(mbs)
    bare_step(model, optimizer, tensors)
    ours, before, bare = [], [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        trainer.train_step(mbs)
        ours.append(num_tokens / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        full.train_step(mbs)
        before.append(num_tokens / (time.perf_counter() - t0))
        t0 = time.perf_counter()
        bare_step(model, optimizer, tensors)
        bare.append(num_tokens / (time.perf_counter() - t0))
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"model {params:.1f}M params, {len(mbs)} micro-batches, {num_tokens} tokens per step, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds")  # fmt: skip
    print(f"trainer tokens/s (median)             {statistics.median(ours):.0f}")
    print(f"trainer, full logits tokens/s (median) {statistics.median(before):.0f}")
    print(f"bare    tokens/s (median)             {statistics.median(bare):.0f}")
    print(f"ratio trainer / bare                   {statistics.median(ours) / statistics.median(bare):.3f}")
    print(f"ratio trainer / full-logits trainer    {statistics.median(ours) / statistics.median(before):.3f}")


if __name__ == "__main__":
    main()
