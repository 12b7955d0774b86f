"""AdamW and the learning-rate schedule (linear warmup, then constant, linear or cosine decay)."""

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
