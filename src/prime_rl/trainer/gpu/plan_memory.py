"""`uv run plan-memory`: will this model train on my GPUs, at this micro-batch length, with this dp x cp?

The prediction is the fake-GPU dry run (`dry_run.py`) of the real trainer with its allocations
counted: rank 0's tensors at the peak of a step after the first (AdamW's state exists), split into
parameters (its FSDP shard of them), gradients, optimizer state and activations (everything else
alive at the peak: activations saved for backward, FSDP's gathered layers, logits chunks,
temporaries). It counts tensor bytes, not the CUDA context, NCCL's buffers or the caching
allocator's fragmentation: `--headroom` keeps a share of the GPU for those when searching the
longest micro-batch that fits.

    uv run plan-memory --model qwen3-8b --seq-len 16384 --dp 8 --cp 2 --ac
    uv run plan-memory --model path/to/config.json --seq-len 8192 --gpu-gib 80 --lora

`--device cpu` plans a CPU run instead (one process, no FSDP), which is how the planner is checked
against measured peaks on a machine without a GPU (`benchmarks/memory.py --plan`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151_936,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    "max_position_embeddings": 131_072,
}
PRESETS: dict[str, dict] = {
    "qwen3-0.6b": {**QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "tie_word_embeddings": True},
    "qwen3-8b": {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": False},
    "qwen3-32b": {**QWEN3, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                  "num_attention_heads": 64, "tie_word_embeddings": False},
}  # fmt: skip
"""Qwen3 shapes (the published configs' sizes); weights are never needed."""

STEP = 1024
"""Granularity of the longest-micro-batch search, in tokens."""


class PlanError(ValueError):
    """A model or setting the planner cannot use; the message is one line."""


def model_folder(model: str, work: Path) -> str:
    """A folder holding the model's config.json: a preset's, a given config.json's, or a model folder."""
    if model in PRESETS:
        folder = work / model
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(PRESETS[model]))
        return str(folder)
    path = Path(model).expanduser()
    if path.is_file() and path.name.endswith(".json"):
        folder = work / "model"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(path.read_text())
        return str(folder)
    if (path / "config.json").is_file():
        return str(path)
    raise PlanError(
        f"--model '{model}': expected a preset ({', '.join(PRESETS)}), an HF config.json, or a folder holding one"
    )


def trainer_config(args, folder: str, tokens: int):
    from prime_rl.trainer.config import TrainerConfig

    fields = {
        "model": {"name": folder, "dtype": args.dtype, "activation_checkpointing": args.ac},
        "seq_len": tokens,
        "parallel": {"cp": args.cp},
        "output_dir": tempfile.mkdtemp(prefix="plan-memory-"),
    }
    if args.lora:
        fields["lora"] = {"rank": args.lora_rank}
    return TrainerConfig(**fields)


def predict(args, folder: str, tokens: int) -> dict[str, int]:
    """Bytes per category at rank 0's peak for micro-batches of `tokens` tokens."""
    import torch

    from prime_rl.trainer.gpu.dry_run import dry_run

    device = torch.device("cpu") if args.device == "cpu" else None
    report = dry_run(
        trainer_config(args, folder, tokens),
        dp=args.dp,
        cp=args.cp,
        micro_batches=args.micro_batches,
        tokens=tokens,
        device=device,
        measure=tracked_step,
    )
    return report.peak


def tracked_step(trainer, batches, step: int) -> dict[str, int]:
    """Bytes per category at the peak of a step after the first (so the optimizer state exists)."""
    import torch
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    class Tracker(MemTracker):
        """Peak bytes by kind, without MemTracker's per-module statistics (which allow one call of
        each module per step; the trainer calls its model once per micro-batch)."""

        def track_gradients(self, module: torch.nn.Module) -> None:
            """Count the gradients of the trained parameters as gradients (MemTracker would do it
            per module call, for frozen parameters too, which cannot take a hook)."""
            for p in module.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(self._count_gradient)

        def _count_gradient(self, p: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(p.grad, _MemRefType.GRAD)

        def _pre_fw_hook(self, module, inputs):
            pass

        def _post_fw_hook(self, module, inputs, outputs):
            pass

        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

    modules = [m for m in (trainer.model, trainer.ref_model, trainer.critic) if m is not None]
    optimizers = [o for o in (trainer.optimizer, trainer.critic_optimizer) if o is not None]
    trainer.train_step(batches, step)  # AdamW allocates its state in the first step
    tracker = Tracker()
    tracker.track_external(*modules, *optimizers)
    for m in modules:
        tracker.track_gradients(m)
    with tracker:
        trainer.train_step(batches, step + 1)
    snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    get = lambda *kinds: sum(snapshot.get(k, 0) for k in kinds)  # noqa: E731
    return {
        "parameters": get(_MemRefType.PARAM, _MemRefType.BUFFER),
        "gradients": get(_MemRefType.GRAD),
        "optimizer": get(_MemRefType.OPT),
        "activations": get(_MemRefType.ACT, _MemRefType.TEMP, _MemRefType.OTH),
        "total": snapshot.get("Total", 0),
    }


def longest_fit(args, folder: str, budget: float, known: dict[int, dict]) -> int:
    """The longest micro-batch (a multiple of STEP, at most --max-tokens) whose predicted peak is
    within `budget` bytes; 0 if not even STEP tokens fit. Peaks grow with tokens, so bisect."""

    def fits(tokens: int) -> bool:
        if tokens not in known:
            known[tokens] = predict(args, folder, tokens)
        return known[tokens]["total"] <= budget

    lo, hi = 0, args.max_tokens // STEP  # in units of STEP: lo fits (0 trivially), hi + 1 does not
    if fits(hi * STEP):
        return hi * STEP
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * STEP):
            lo = mid
        else:
            hi = mid - 1
    return lo * STEP


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="plan-memory",
        description="Predicted peak memory per GPU of one trainer step (a fake-GPU dry run of the real trainer).",
    )
    ap.add_argument(
        "--model",
        required=True,
        help=f"a preset ({', '.join(PRESETS)}), an HF config.json, or a model folder",
    )
    ap.add_argument(
        "--seq-len", type=int, default=4096, help="tokens per micro-batch (the trainer's seq_len)"
    )
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    ap.add_argument("--cp", type=int, default=1, help="context-parallel ranks per replica")
    ap.add_argument("--lora", action="store_true", help="train LoRA adapters instead of the full weights")
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--ac", action="store_true", help="activation checkpointing")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--micro-batches", type=int, default=1, help="micro-batches per step on each rank")
    ap.add_argument(
        "--gpu-gib", type=float, default=80.0, help="memory of one GPU in GiB (an 80 GB H100 has 79.6)"
    )
    ap.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="share of the GPU kept for what is not a tensor (CUDA context, NCCL, fragmentation)",
    )
    ap.add_argument(
        "--max-tokens", type=int, default=131_072, help="upper end of the longest-micro-batch search"
    )
    ap.add_argument("--no-search", action="store_true", help="skip the longest-micro-batch search")
    ap.add_argument(
        "--device", choices=["gpu", "cpu"], default="gpu", help="plan a GPU run (default) or a CPU one"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = ap.parse_args(argv)
    if args.dp < 1 or args.cp < 1 or args.seq_len < 2:
        ap.error("--dp and --cp must be at least 1 and --seq-len at least 2")

    from prime_rl.trainer.gpu.dry_run import DryRunError
    from prime_rl.trainer.parallel.dist import exit_now

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        try:
            folder = model_folder(args.model, Path(work))
            known = {args.seq_len: predict(args, folder, args.seq_len)}
            budget = args.gpu_gib * GIB * (1 - args.headroom)
            fit = None if args.no_search else longest_fit(args, folder, budget, known)
        except (PlanError, DryRunError) as e:
            sys.stderr.write(f"plan-memory: error: {e}\n")
            exit_now(2)
    peak = known[args.seq_len]
    if args.json:
        print(
            json.dumps({"peak_bytes": peak, "longest_micro_batch": fit, "seconds": time.perf_counter() - t0})
        )
        exit_now(0)
    where = "CPU process" if args.device == "cpu" else "GPU"
    setup = f"dp {args.dp} x cp {args.cp}" + (", LoRA" if args.lora else "") + (", AC" if args.ac else "")
    print(f"plan-memory: {args.model}, {args.dtype}, {setup}, micro-batches of {args.seq_len} tokens")
    print(f"peak per {where} (rank 0, a step after the first):")
    for key in ("parameters", "gradients", "optimizer", "activations"):
        print(f"  {key:<12} {gib(peak[key]):>12}")
    print(f"  {'total':<12} {gib(peak['total']):>12}")
    if fit is not None:
        usable = f"{args.gpu_gib:g} GiB less {args.headroom:.0%} headroom"
        verdict = f"{fit} tokens" if fit else f"none (not even {STEP} tokens)"
        print(f"longest micro-batch that fits {usable}: {verdict} (searched up to {args.max_tokens})")
    print(f"({time.perf_counter() - t0:.1f}s)")
    exit_now(0)


if __name__ == "__main__":
    main()
