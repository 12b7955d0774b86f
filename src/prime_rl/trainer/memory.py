"""What to do when a trainer step runs out of memory: one line naming the knobs, not an allocator error.

Invariant: only allocation failures become `OutOfMemory` (CUDA's OutOfMemoryError, and the CPU
allocator's "can't allocate memory"); the advice lists the memory knobs that are not yet at their
frugal setting, most effective first, with the values that would change.
"""

from __future__ import annotations

import torch

from prime_rl.trainer.config import TrainingConfig
from prime_rl.trainer.parallel.dist import World


class OutOfMemory(RuntimeError):
    """A step needed more memory than the device has."""


def is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def advice(config: TrainingConfig, ranks: int) -> list[str]:
    """The knobs to turn, as `key = value` suggestions, for a step that did not fit."""
    model, cp = config.model, config.parallel.cp
    out = []
    if not model.activation_checkpointing:
        out.append("trainer.model.activation_checkpointing = true")
    if ranks % (2 * cp) == 0 and config.seq_len >= 4 * cp:
        out.append(f"trainer.parallel.cp = {2 * cp} (tokens per rank / 2)")
    out.append(f"seq_len = {config.seq_len // 2} (the micro-batch token budget; now {config.seq_len})")
    if (model.logprob_chunk_tokens or 256) > 64:
        out.append(f"trainer.model.logprob_chunk_tokens = {(model.logprob_chunk_tokens or 256) // 4}")
    if model.dtype == "float32":
        out.append('trainer.model.dtype = "bfloat16"')
    if ranks == 1 or ranks % (2 * cp):
        out.append("more trainer ranks (FSDP shards parameters, gradients and optimizer state over them)")
    return out


def out_of_memory(
    error: BaseException, config: TrainingConfig, step: int, tokens: int, ranks: int
) -> OutOfMemory:
    where = "GPU" if isinstance(error, torch.OutOfMemoryError) else "CPU"
    first = " ".join(str(error).split())[:160]
    return OutOfMemory(
        f"step {step} ran out of {where} memory on micro-batches of up to {tokens} tokens ({first}). "
        f"To fit, try: {'; '.join(advice(config, ranks))}. See 'Memory' in docs/trainer.md."
    )


def peak_memory_gb(world: World) -> float:
    """This process's peak memory so far: CUDA's allocator on a GPU, else the peak RSS."""
    if world.device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def keep_freed_memory(world: World) -> bool:
    """On a CPU trainer, keep freed memory in this process's heap (glibc's mallopt): by default glibc
    maps every block above 32 MB afresh and unmaps it when freed, so each step paid page faults for
    its large activations again, and micro-batches of 32k tokens trained at 0.76x the speed of 8k
    ones (`benchmarks/trainer.py`). The heap then holds the step's peak, which the next step needs
    anyway. True when set (glibc only; elsewhere nothing changes)."""
    if world.device.type != "cpu":
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        return bool(libc.mallopt(m_mmap_threshold, 1 << 30) and libc.mallopt(m_trim_threshold, 1 << 31))
    except (OSError, AttributeError):
        return False
