"""The table of `plan-memory` predictions in docs/gpu.md: the longest micro-batch that fits one GPU.

    uv run python benchmarks/plan_table.py [--models qwen3-8b qwen3-32b] [--gpu-gib 80] [--ranks 8]

One node of `--ranks` GPUs, dp x cp = ranks, bfloat16, one micro-batch per step; for cp = 1, 2, 4, 8,
with and without activation checkpointing and LoRA (rank 16). Each cell is the longest micro-batch (a
multiple of 1,024 tokens, searched up to 131,072) whose predicted peak fits the GPU less 10%
headroom. All dry runs share this process, so the search costs the dry runs, not imports.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from prime_rl.trainer.gpu.plan_memory import GIB, longest_fit, model_folder
from prime_rl.trainer.parallel.dist import exit_now


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen3-8b", "qwen3-32b"])
    ap.add_argument("--gpu-gib", type=float, default=80.0)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--max-tokens", type=int, default=131_072)
    args = ap.parse_args()
    budget = args.gpu_gib * GIB * 0.9
    print(
        f"longest micro-batch per GPU within {args.gpu_gib:g} GiB less 10%, {args.ranks} GPUs (dp x cp), bfloat16"
    )
    print("| model | training | " + " | ".join(f"cp {cp} (dp {args.ranks // cp})" for cp in args.cps) + " |")
    print("|---|---|" + "---|" * len(args.cps))
    with tempfile.TemporaryDirectory() as work:
        for model in args.models:
            folder = model_folder(model, Path(work))
            for lora in (False, True):
                for ac in (False, True):
                    t0, cells = time.perf_counter(), []
                    for cp in args.cps:
                        plan = argparse.Namespace(dp=args.ranks // cp, cp=cp, lora=lora, lora_rank=16, ac=ac,
                                                  dtype="bfloat16", micro_batches=1, device="gpu",
                                                  max_tokens=args.max_tokens)  # fmt: skip
                        fit = longest_fit(plan, folder, budget, {})
                        cells.append(f"{fit:,}" if fit < args.max_tokens else f">= {fit:,}")
                    what = ("LoRA" if lora else "full") + (", AC" if ac else "")
                    print(f"| {model} | {what} | " + " | ".join(cells) + f" |  <!-- {time.perf_counter() - t0:.0f}s -->",
                          flush=True)  # fmt: skip
    exit_now(0)  # the fake GPU's autograd thread must not meet interpreter shutdown (dist.exit_now)


if __name__ == "__main__":
    main()
