"""The CUDA path on a real GPU: what the fake-GPU dry run cannot prove.

    bash scripts/gpu_check.sh          # on a machine with one CUDA GPU

1. Parity: one trainer step (dp = 1, float32) on the same packed micro-batches, on the CPU and on
   CUDA: loss, gradient norm, and the mean |difference| of the per-token trainer logprobs.
2. Memory: `plan-memory`'s predicted peak (run first, in its own process) against
   `torch.cuda.max_memory_allocated` of the second step (AdamW's state exists), for a
   real-vocabulary model in float32 and Qwen3-0.6B's shape in bfloat16 with activation checkpointing.
Prints a table; with $OUT set, also writes $OUT/gpu_check.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.gpu.dry_run import synthetic_samples
from prime_rl.trainer.gpu.plan_memory import PRESETS
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.rl.trainer import Trainer
from prime_rl.transport.packing import pack

REAL_VOCAB = {**PRESETS["qwen3-0.6b"], "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "tie_word_embeddings": False}  # fmt: skip


def make_model(shape: dict, folder: Path) -> Path:
    """Random weights (seed 0) of `shape`, saved as an HF folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(**{k: v for k, v in shape.items() if k != "architectures"})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def config_for(model: Path, tokens: int, dtype: str, ac: bool) -> TrainerConfig:
    return TrainerConfig(model={"name": str(model), "dtype": dtype, "activation_checkpointing": ac},
                         seq_len=tokens, output_dir=tempfile.mkdtemp())  # fmt: skip


def step(config: TrainerConfig, device: torch.device, tokens: int):
    trainer = Trainer(config, World(device=device))
    batches = pack(synthetic_samples(tokens, trainer.model.config.vocab_size), tokens, 1, "gpu-check", 0)[0]
    first, results = trainer.train_step(batches)
    return trainer, batches, first, results


def parity(model: Path, tokens: int) -> dict:
    config = config_for(model, tokens, "float32", ac=False)
    cpu_trainer, _, cpu, cpu_results = step(config, torch.device("cpu"), tokens)
    del cpu_trainer
    _, _, gpu, gpu_results = step(config, torch.device("cuda"), tokens)
    diff = max(
        float((a.trainer_logprobs - b.trainer_logprobs.cpu()).abs().mean())
        for a, b in zip(cpu_results, gpu_results, strict=True)
    )
    return {"tokens": tokens, "loss_cpu": cpu["loss"], "loss_cuda": gpu["loss"], "grad_norm_cpu": cpu["grad_norm"],
            "grad_norm_cuda": gpu["grad_norm"], "logprob_mean_abs_diff": diff}  # fmt: skip


def planned(model: Path, tokens: int, dtype: str, ac: bool) -> int | None:
    cmd = [sys.executable, "-m", "prime_rl.trainer.gpu.plan_memory", "--model", str(model), "--seq-len", str(tokens),
           "--dtype", dtype, "--no-search", "--json"] + (["--ac"] if ac else [])  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:  # reported, and the measurements still run
        print(f"plan-memory failed for {model.name} at {tokens} tokens:\n{done.stderr[-2000:]}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"]["total"]


def measured(model: Path, tokens: int, dtype: str, ac: bool) -> int:
    trainer, batches, _, _ = step(config_for(model, tokens, dtype, ac), torch.device("cuda"), tokens)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    trainer.train_step(batches, 1)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del trainer
    torch.cuda.empty_cache()
    return peak


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device")
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp())
    real_vocab = make_model(REAL_VOCAB, work / "real-vocab")
    qwen = make_model(PRESETS["qwen3-0.6b"], work / "qwen3-0.6b")
    cases = [(real_vocab, 4096, "float32", False), (qwen, 8192, "bfloat16", True)]
    plans = {c: planned(*c) for c in cases}  # before this process touches CUDA memory
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "parity": parity(real_vocab, 4096),
    }
    print(report["parity"], flush=True)
    report["memory"] = []
    for case in cases:
        got = measured(*case)
        plan = plans[case] or float("nan")
        report["memory"].append({"model": case[0].name, "tokens": case[1], "dtype": case[2], "ac": case[3],
                                 "planned_gib": plan / 2**30, "measured_gib": got / 2**30,
                                 "planned_over_measured": plan / got})  # fmt: skip
        print(report["memory"][-1], flush=True)
    p = report["parity"]
    print(f"gpu_check on {report['device']} (torch {report['torch']}), {time.perf_counter() - t0:.0f}s")
    print(f"parity, real-vocab float32, {p['tokens']} tokens: loss cpu {p['loss_cpu']:.6f} cuda {p['loss_cuda']:.6f}; "
          f"grad_norm cpu {p['grad_norm_cpu']:.4f} cuda {p['grad_norm_cuda']:.4f}; "
          f"mean |logprob diff| {p['logprob_mean_abs_diff']:.2e}")  # fmt: skip
    print("| model | tokens | dtype | AC | planned | max_memory_allocated | planned / measured |")
    print("|---|---|---|---|---|---|---|")
    for m in report["memory"]:
        print(f"| {m['model']} | {m['tokens']} | {m['dtype']} | {m['ac']} | {m['planned_gib']:.2f} GiB | "
              f"{m['measured_gib']:.2f} GiB | {m['planned_over_measured']:.3f} |")  # fmt: skip
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_check.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
