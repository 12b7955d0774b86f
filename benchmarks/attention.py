"""Packed attention mechanisms: tokens/s of a model's forward + backward on packed micro-batches,
against today's dense-mask path (transformers' sdpa with a [T, T] mask built from position ids).

    python benchmarks/attention.py                      # CUDA when present, else CPU
    python benchmarks/attention.py --device cpu --layers 2 --hidden 256 --sizes 512,2048,8192

Micro-batches of 512 to 32k tokens made of short samples (~40 tokens) and of long ones (~2k). For
each mechanism of `prime_rl.trainer.attention` (and sdpa-dense) and each micro-batch: tokens/s
(median of rounds) and the peak memory above the model's (CUDA). A parity check first, in float32:
logits and gradients of every mechanism against sdpa-dense. With $OUT set, writes attention.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
import traceback

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from prime_rl.trainer.attention import use_packed_attention


def packed_positions(tokens: int, mean_len: int, seed: int = 0) -> torch.Tensor:
    rng = random.Random(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(min(max(1, int(rng.uniform(0.5, 1.5) * mean_len)), tokens - sum(lengths)))
    return torch.cat([torch.arange(n) for n in lengths])


def build(args, dtype, layers=None):
    torch.manual_seed(0)
    h = args.hidden
    heads = max(2, h // args.head_dim)
    config = AutoConfig.for_model("qwen3", hidden_size=h, intermediate_size=3 * h, num_hidden_layers=layers or args.layers,
                                  num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=args.head_dim,
                                  vocab_size=args.vocab, max_position_embeddings=65536)  # fmt: skip
    return AutoModelForCausalLM.from_config(config).to(device=args.device, dtype=dtype)


def set_mechanism(model, name: str) -> None:
    if name == "sdpa-dense":
        model.set_attn_implementation("sdpa")
    else:
        use_packed_attention(model, name)


def fwd_bwd(model, ids, pos):
    logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits
    logits.float().logsumexp(-1).mean().backward()
    return logits


def parity(args, mechanisms) -> dict:
    model = build(args, torch.float32, layers=2)
    pos = packed_positions(300, 40, seed=1).to(args.device)
    pos = torch.cat([pos, torch.zeros(1, dtype=pos.dtype, device=pos.device)])  # a sample of length 1
    ids = torch.randint(0, args.vocab, pos.shape, device=args.device)
    results = {}
    ref_logits, ref_grads = None, None
    for name in ["sdpa-dense", *mechanisms]:
        try:
            set_mechanism(model, name)
            model.zero_grad()
            logits = fwd_bwd(model, ids, pos).detach()
            grads = [p.grad.detach().clone() for p in model.parameters()]
            if ref_logits is None:
                ref_logits, ref_grads = logits, grads
                continue
            results[name] = {"logits_max_abs": float((logits - ref_logits).abs().max()),
                             "grad_max_abs": max(float((a - b).abs().max()) for a, b in zip(grads, ref_grads, strict=True))}  # fmt: skip
        except Exception as e:  # a mechanism this device lacks is reported, not fatal
            results[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        print(f"parity {name}: {results.get(name)}", flush=True)
    return results


def throughput(args, mechanisms) -> list[dict]:
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = build(args, dtype)
    rows = []
    cases = [(kind, mean_len, tokens) for kind, mean_len in (("short", 40), ("long", 2048))
             for tokens in args.sizes if tokens >= mean_len]  # fmt: skip
    # Mechanism by mechanism, so that a deadline cuts the last one (flex, whose compiles are slow).
    for name in ["sdpa-dense", *mechanisms]:
        for kind, mean_len, tokens in cases:
            row = {"samples": kind, "tokens": tokens, "mechanism": name}
            if time.perf_counter() > args.deadline:
                row["error"] = "skipped: past --deadline-s"
                rows.append(row)
                continue
            pos = packed_positions(tokens, mean_len).to(args.device)
            ids = torch.randint(0, args.vocab, pos.shape, device=args.device)
            try:
                set_mechanism(model, name)
                for _ in range(args.warmup):
                    fwd_bwd(model, ids, pos)
                    model.zero_grad(set_to_none=True)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                rates = []
                for _ in range(args.rounds):
                    t0 = time.perf_counter()
                    fwd_bwd(model, ids, pos)
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    rates.append(tokens / (time.perf_counter() - t0))
                    model.zero_grad(set_to_none=True)
                row["tokens_per_s"] = statistics.median(rates)
                if args.device == "cuda":
                    row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                if args.verbose:
                    traceback.print_exc()
                model.zero_grad(set_to_none=True)
                if args.device == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--sizes", default="512,2048,8192,32768")
    ap.add_argument("--mechanisms", default="per_sample,flex,varlen")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=1e9, help="skip the cases that would start later")
    args = ap.parse_args()
    args.deadline = time.perf_counter() + args.deadline_s
    args.sizes = [int(s) for s in args.sizes.split(",")]
    mechanisms = args.mechanisms.split(",")
    t0 = time.perf_counter()
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
              "args": {k: v for k, v in vars(args).items()}}  # fmt: skip
    report["parity"] = parity(args, mechanisms)
    report["throughput"] = throughput(args, mechanisms)
    print(f"\n{report['device']}, torch {report['torch']}, {time.perf_counter() - t0:.0f}s")
    print("| samples | tokens | mechanism | tokens/s | vs sdpa-dense | vs same mechanism at 512 | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    rows = report["throughput"]
    rows = sorted(rows, key=lambda r: (r["samples"] == "long", r["tokens"]))
    for r in rows:
        dense = next((x for x in rows if x["samples"] == r["samples"] and x["tokens"] == r["tokens"]
                      and x["mechanism"] == "sdpa-dense" and "tokens_per_s" in x), None)  # fmt: skip
        small = next((x for x in rows if x["samples"] == r["samples"] and x["mechanism"] == r["mechanism"]
                      and "tokens_per_s" in x), None)  # fmt: skip
        if "tokens_per_s" not in r:
            print(f"| {r['samples']} | {r['tokens']} | {r['mechanism']} | {r['error']} | | | |")
            continue
        vs_dense = r["tokens_per_s"] / dense["tokens_per_s"] if dense else float("nan")
        vs_small = r["tokens_per_s"] / small["tokens_per_s"] if small else float("nan")
        print(f"| {r['samples']} | {r['tokens']} | {r['mechanism']} | {r['tokens_per_s']:.0f} | {vs_dense:.2f} | "
              f"{vs_small:.2f} | {r.get('peak_gib', float('nan')):.2f} |")  # fmt: skip
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "attention.json"), "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
