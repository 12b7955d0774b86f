"""Load the model to train, and shard it with FSDP2 when there are several ranks.

Invariant: with FSDP2 every rank holds a shard of every parameter (DTensors); gradients are
reduce-scattered in backward and divided by the size of the parameter's FSDP group (all ranks, or
ranks / ep for the experts under expert parallelism), which the trainer undoes (`fsdp_group_size`,
used by `Trainer.accumulate`). On one rank the model is a plain module.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from prime_rl.trainer import lora as lora_layers
from prime_rl.trainer.attention import configure_attention
from prime_rl.trainer.config import LoRAConfig, TrainedModelConfig
from prime_rl.trainer.logprobs import attach_position_logprobs
from prime_rl.trainer.moe.expert_parallel import ep_problem, fsdp_experts, shard_experts
from prime_rl.trainer.parallel.dist import World

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """The configured model cannot be loaded."""


def load_model(
    config: TrainedModelConfig, world: World, lora: LoRAConfig | None = None, seed: int = 0
) -> torch.nn.Module:
    """The model to train, with LoRA adapters (drawn from `seed`) on it when `lora` is set."""
    from transformers import AutoModelForCausalLM

    try:
        with building(world):
            model = instantiate(AutoModelForCausalLM, config.name, config.dtype, world)
    except Exception as e:
        raise ModelLoadError(
            f"model '{config.name}' could not be loaded with transformers: {type(e).__name__}: {' '.join(str(e).split())}. "
            "Give a local HF folder (config.json, safetensors, tokenizer) or a hub id that is reachable."
        ) from None
    if lora is not None:
        with building(world):
            add_adapters(model, lora, seed, key="trainer.model.name", name=config.name)
    place(model, world)
    prepare_model(model, config, world, key="trainer.model.name")
    attach_position_logprobs(model)
    if world.distributed:
        # The trainer calls this method instead of forward (body, then the lm_head in chunks).
        register_fsdp_forward_method(model, "prime_rl_position_logprobs")
    return model


def building(world: World):
    """Where a dry run builds its modules: outside its fake-tensor mode, on the meta device (module
    surgery such as peft's swaps parameters, which fake tensors do not allow); `place` then gives
    them fake tensors."""
    if not world.fake:
        return contextlib.nullcontext()
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def instantiate(auto_cls, name: str, dtype: str, world: World) -> torch.nn.Module:
    """`auto_cls.from_pretrained(name)`; in a dry run, the same architecture built from its config
    alone on the meta device (no weights are read; `place` gives it fake tensors)."""
    if not world.fake:
        return auto_cls.from_pretrained(name, dtype=DTYPES[dtype])
    from transformers import AutoConfig

    with torch.device("meta"):
        return auto_cls.from_config(AutoConfig.from_pretrained(name), dtype=DTYPES[dtype])


def place(module: torch.nn.Module, world: World) -> None:
    """Move `module` to the training device (a dry run's meta module gets fake tensors there)."""
    if world.fake:
        from prime_rl.trainer.parallel.fake_gpu import materialize

        materialize(module, world.device)
    else:
        module.to(world.device)


def add_adapters(model: torch.nn.Module, lora: LoRAConfig, seed: int, key: str, name: str) -> None:
    missing = lora_layers.unmatched_targets(model, lora.target_modules)
    if missing:
        raise ModelLoadError(
            f"trainer.lora.target_modules: {', '.join(repr(m) for m in missing)} names no linear layer of "
            f"{key} = '{name}'; its linear layers are {', '.join(lora_layers.linear_suffixes(model))}"
        )
    lora_layers.inject(model, lora, seed)


def prepare_model(model: torch.nn.Module, config: TrainedModelConfig, world: World, key: str) -> None:
    """Packed (or context-parallel) attention, expert parallelism, activation checkpointing and FSDP2 sharding,
    as configured."""
    experts = []
    if world.ep > 1:
        problem = ep_problem(model, world.ep)
        if problem:
            raise ModelLoadError(
                f"trainer.parallel.ep = {world.ep}, but {key} = '{config.name}' cannot be split into "
                f"experts across ranks: {problem}. Use ep = 1 for this model."
            )
        experts = shard_experts(model, world)
    set_attention(model, config.attention, world, key, config.name)
    if config.activation_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if world.distributed:
        # The experts first: their own FSDP group keeps them out of their layer's.
        fsdp_experts(experts, world, config.reshard_after_forward)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=world.mesh, reshard_after_forward=config.reshard_after_forward)
        fully_shard(model, mesh=world.mesh, reshard_after_forward=config.reshard_after_forward)
    model.train()


def set_attention(model: torch.nn.Module, requested: str, world: World, key: str, name: str) -> None:
    """The configured attention mechanism (`trainer.model.attention`), or one line saying why not."""
    try:
        configure_attention(model, requested, world.device, world.cp)
    except ValueError as e:
        cp = f" with trainer.parallel.cp = {world.cp}" if world.cp > 1 else ""
        raise ModelLoadError(
            f"trainer.model.attention = '{requested}'{cp} for {key} = '{name}': {e}"
        ) from None


def fsdp_group_size(param: torch.Tensor) -> int:
    """How many ranks FSDP averaged `param`'s gradient over: the first (sharding) dimension of its
    mesh; 1 for a plain tensor."""
    mesh = getattr(param, "device_mesh", None)
    return mesh.size(0) if mesh is not None else 1


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one (HF causal LMs keep them in model.model.layers)."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []
