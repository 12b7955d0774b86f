"""Packing: how much of what the trainer computes is filler, on realistic length distributions.

    uv run python benchmarks/packing.py

For each workload and rank count it packs one step's samples with the orchestrator's packer and
prints: filler tokens as a fraction of all tokens sent (the number the 2% target is about), how full
the micro-batches are (real tokens / (micro-batches x seq_len): fewer, fuller micro-batches mean
fewer forward passes), and the same fill for the naive alternative of one sample per micro-batch,
as a ratio. Lengths are drawn from a seed, so the figures are exact, not timings.
"""

from __future__ import annotations

import random
import time

from prime_rl.transport.messages import TrainingSample
from prime_rl.transport.packing import pack


def sample(prompt_len: int, completion_len: int) -> TrainingSample:
    c = completion_len
    return TrainingSample([5] * prompt_len, [6] * c, [1] * c, [-1.0] * c, 0.5, 1.0, "env")


def reverse_text(rng: random.Random) -> TrainingSample:
    # The example env: a ~70-token chat prompt, 4-17 completion tokens.
    return sample(rng.randint(64, 76), rng.randint(4, 17))


def reasoning(rng: random.Random) -> TrainingSample:
    # Long-tailed completions (median ~800 tokens, capped by max_tokens 6000), prompts 50-500.
    return sample(rng.randint(50, 500), min(6000, max(1, int(rng.lognormvariate(6.7, 0.8)))))


def multi_turn(rng: random.Random) -> TrainingSample:
    # Merged multi-turn samples: a few turns of 100-600 tokens each.
    return sample(rng.randint(100, 300), sum(rng.randint(100, 600) for _ in range(rng.randint(1, 5))))


WORKLOADS = [
    ("reverse_text", reverse_text, 128, 512),
    ("reasoning", reasoning, 256, 8192),
    ("multi_turn", multi_turn, 256, 8192),
]


def main() -> None:
    print(f"{'workload':<14}{'ranks':>6}{'mbs/rank':>10}{'filler %':>10}{'fill':>8}{'naive fill':>12}"
          f"{'fill ratio':>12}{'pack ms':>9}")  # fmt: skip
    for name, draw, batch, seq_len in WORKLOADS:
        rng = random.Random(0)
        samples = [draw(rng) for _ in range(batch)]
        real = sum(len(s) for s in samples)
        naive_fill = real / (len(samples) * seq_len)
        for ranks in (1, 2, 8):
            t0 = time.perf_counter()
            per_rank = pack(samples, seq_len, ranks, "bench", 0)
            ms = (time.perf_counter() - t0) * 1e3
            sent = sum(mb.num_tokens for mbs in per_rank for mb in mbs)
            mbs = sum(len(m) for m in per_rank)
            fill = real / (mbs * seq_len)
            print(f"{name:<14}{ranks:>6}{len(per_rank[0]):>10}{100 * (sent - real) / sent:>10.3f}{fill:>8.3f}"
                  f"{naive_fill:>12.3f}{fill / naive_fill:>12.1f}{ms:>9.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
