"""Load the model to train, and shard it with FSDP2 when there are several ranks.

Invariant: with FSDP2 every rank holds a shard of every parameter (DTensors); gradients are
reduce-scattered in backward and divided by the data-parallel size, which the trainer undoes
(see `Trainer.accumulate`). On one rank the model is a plain module.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import fully_shard

from prime_rl.trainer.config import ModelConfig
from prime_rl.trainer.dist import World

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """The configured model cannot be loaded."""


def load_model(config: ModelConfig, world: World) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(config.name, dtype=DTYPES[config.dtype])
    except Exception as e:
        raise ModelLoadError(
            f"model '{config.name}' could not be loaded with transformers: {type(e).__name__}: {' '.join(str(e).split())}. "
            "Give a local HF folder (config.json, safetensors, tokenizer) or a hub id that is reachable."
        ) from None
    model.to(world.device)
    if config.activation_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if world.distributed:
        for layer in decoder_layers(model):
            fully_shard(layer, reshard_after_forward=config.reshard_after_forward)
        fully_shard(model, reshard_after_forward=config.reshard_after_forward)
    model.train()
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one (HF causal LMs keep them in model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []
