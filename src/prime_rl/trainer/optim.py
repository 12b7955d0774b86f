"""AdamW, gradient clipping and the learning-rate schedule (linear warmup, then constant, linear or
cosine decay)."""

from __future__ import annotations

import math

import torch

from prime_rl.trainer.config import OptimizerConfig, SchedulerConfig


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    # foreach=False: the foreach kernels do not support every DTensor placement on CPU.
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        foreach=False,
    )


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` for parameters sharded over different device meshes (expert
    parallelism puts the experts on their own): the norm of each mesh's gradients is completed over
    its ranks first, then the norms are combined. Returns the total norm as a plain tensor on every
    rank; the clip coefficient is the same as torch's."""
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    if not by_mesh:
        return torch.zeros(())
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grads in by_mesh.values():
        for g in grads:
            # A DTensor gradient is scaled through its local shard: the coefficient is the same on
            # every rank, and a plain tensor cannot meet a DTensor in one op.
            (g.to_local() if hasattr(g, "to_local") else g).mul_(coef.to(g.dtype))
    return total


def lr_factor(step: int, config: SchedulerConfig, max_steps: int) -> float:
    """Multiplier of the peak learning rate for the update of step `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    if config.type == "constant":
        return 1.0
    span = max(max_steps - config.warmup_steps, 1)
    progress = min((step - config.warmup_steps) / span, 1.0)
    floor = config.min_lr_ratio
    if config.type == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer, config: SchedulerConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config, max_steps))
