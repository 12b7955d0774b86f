"""Build every module the trainer runs: the policy, its reference, the critic and the reward model.

One sequence for all of them (`build_model`): instantiate from the folder or hub id, add LoRA
adapters, put a scalar head on the body where one is asked for (`head.ScalarHead`), place it on the
device, split the experts across ranks (the causal LMs, under `parallel.ep`), set the attention and
activation checkpointing, and shard it with FSDP2 on several ranks.

Invariant: with FSDP2 every rank holds a shard of every parameter (DTensors); gradients are
reduce-scattered in backward and divided by the size of the parameter's FSDP group (all ranks, or
ranks / ep for the experts under expert parallelism), which the trainer undoes (`fsdp_group_size`,
used by `step.undo_fsdp_average`). On one rank a module is a plain module. `fully_shard` is called
here only (and in `moe/` for the experts' own groups).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from prime_rl.trainer import lora as lora_layers
from prime_rl.trainer.attention import configure_attention
from prime_rl.trainer.config import LoRAConfig, TrainedModelConfig
from prime_rl.trainer.head import ScalarHead
from prime_rl.trainer.logprobs import attach_position_logprobs
from prime_rl.trainer.moe.expert_parallel import ep_problem, fsdp_experts, shard_experts
from prime_rl.trainer.parallel.dist import World

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """The configured model cannot be loaded."""


def build_model(
    config: TrainedModelConfig,
    world: World,
    *,
    name: str | None = None,
    key: str = "trainer.model.name",
    role: str = "the model",
    lora: LoRAConfig | None = None,
    seed: int = 0,
    head: Callable[[torch.nn.Module], ScalarHead] | None = None,
    check: Callable[[torch.nn.Module], None] | None = None,
    trained: bool = True,
) -> torch.nn.Module:
    """The module to run, built from `name` (default `config.name`) with `config`'s dtype, attention,
    activation checkpointing and resharding. `key`, `role`: the config key that names it and what
    it is, for errors; `lora`: adapters drawn from `seed`; `head`: wraps the body (transformers'
    `AutoModel`) into a scalar model (None: the causal LM with its own head, and the chunked
    logprobs the trainer calls instead of forward); `check`: refuses the built module before it is
    placed; `trained=False`: frozen (a reference)."""
    from transformers import AutoModel, AutoModelForCausalLM

    name = name or config.name
    try:
        with building(world):
            model = instantiate(
                AutoModelForCausalLM if head is None else AutoModel, name, config.dtype, world
            )
    except Exception as e:
        raise ModelLoadError(
            f"{key} = '{name}': {role} could not be loaded with transformers: {type(e).__name__}: "
            f"{' '.join(str(e).split())}. Give a local HF folder (config.json, safetensors, tokenizer) "
            "or a hub id that is reachable."
        ) from None
    with building(world):
        if lora is not None:
            add_adapters(model, lora, seed, key=key, name=name)
        if head is not None:
            model = head(model).to(dtype=DTYPES[config.dtype])
        if check is not None:
            check(model)
    place(model, world)
    prepare_model(model, config, world, key, name, experts=head is None)
    if head is None:
        attach_position_logprobs(model)
        if world.distributed:
            # The trainer calls this method instead of forward (body, then the lm_head in chunks).
            register_fsdp_forward_method(model, "prime_rl_position_logprobs")
    if not trained:
        model.requires_grad_(False)
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


def prepare_model(
    model: torch.nn.Module, config: TrainedModelConfig, world: World, key: str, name: str, experts: bool
) -> None:
    """Expert parallelism (`experts`: a causal LM's), packed (or context-parallel) attention,
    activation checkpointing and FSDP2 sharding, as configured."""
    body = model.body if isinstance(model, ScalarHead) else model
    split = []
    if experts and world.ep > 1:
        problem = ep_problem(model, world.ep)
        if problem:
            raise ModelLoadError(
                f"trainer.parallel.ep = {world.ep}, but {key} = '{name}' cannot be split into "
                f"experts across ranks: {problem}. Use ep = 1 for this model."
            )
        split = shard_experts(model, world)
    set_attention(body, config.attention, world, key, name)
    if config.activation_checkpointing:
        body.gradient_checkpointing_enable()
        body.config.use_cache = False
    if world.distributed:
        # The experts first: their own FSDP group keeps them out of their layer's.
        fsdp_experts(split, world, config.reshard_after_forward)
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
    """The repeated blocks to shard one by one: the first `layers` list of the module, wherever the
    architecture keeps it (`model.layers` of a causal LM, `body.layers` of a scalar head's body)."""
    for path, module in model.named_modules():
        if path.rsplit(".", 1)[-1] == "layers" and isinstance(module, torch.nn.ModuleList):
            return list(module)
    return []
