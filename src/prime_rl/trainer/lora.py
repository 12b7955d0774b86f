"""LoRA adapters on the trained model (peft's LoRA layers), and the adapter's files as vLLM loads them.

Invariants:
- The model stays the HF model the rest of the trainer knows: peft's layers are injected in place
  (`model.layers.0.self_attn.q_proj` becomes a `lora.Linear` holding the frozen `base_layer`), so
  logprobs, FSDP2 sharding, activation checkpointing and context parallelism see the same modules.
- Only the adapter's parameters require gradients: the optimizer, FSDP's reduce-scatter, checkpoints
  (frozen parameters left out) and publishing hold the adapter and nothing else.
- The adapter starts as the identity (B = 0) with A drawn from the trainer's seed, the same on every
  rank, so step 0 serves the base model's distribution and every rank holds the same adapter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from prime_rl.trainer.config import LoRAConfig

ADAPTER = "default"
"""peft's name of the one adapter the trainer injects; it appears in parameter names."""

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def linear_suffixes(model: torch.nn.Module) -> list[str]:
    """The distinct last name parts of the model's linear layers (what target modules may name)."""
    return sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )


def unmatched_targets(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The target module names that name no linear layer of `model` (matched on the last name part,
    as peft does)."""
    have = set(linear_suffixes(model))
    return [t for t in targets if t not in have]


def inject(model: torch.nn.Module, config: LoRAConfig, seed: int) -> None:
    """Put LoRA layers on `model`'s target modules, in place, and freeze everything else."""
    from peft import inject_adapter_in_model

    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the same A on every rank and every run
        inject_adapter_in_model(peft_config(config, base=""), model, adapter_name=ADAPTER)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)


def peft_config(config: LoRAConfig, base: str):
    from peft import LoraConfig

    return LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        target_modules=list(config.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base or None,
    )


@contextmanager
def adapters_off(model: torch.nn.Module) -> Iterator[None]:
    """The base model, for the length of the block: the frozen reference of KL penalties, without
    a second copy of the weights."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)  # which makes the adapter's weights require gradients again


def is_adapter_key(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def adapter_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a full state dict, under the names of peft's saved files (which vLLM
    reads): `model.layers.0.self_attn.q_proj.lora_A.default.weight` ->
    `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    return {
        "base_model.model." + k.replace(f".{ADAPTER}.", "."): v for k, v in state.items() if is_adapter_key(k)
    }


def write_adapter(path: Path, tensors: dict[str, torch.Tensor], config: LoRAConfig, base: str) -> None:
    """`adapter_config.json` and `adapter_model.safetensors` in `path` (which exists)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(
        json.dumps(peft_config(config, base).to_dict(), indent=2, default=list)
    )


_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


def merge(
    base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scale: float
) -> dict[str, torch.Tensor]:
    """Base weights with the adapter folded in, W + scale * B @ A (in float32, then the base's dtype),
    under the base model's own names: what transformers and vLLM load without LoRA."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in adapter.items():
        m = _LORA_KEY.match(key)
        if m is None:
            raise ValueError(f"'{key}' is not a LoRA weight of peft's format")
        pairs.setdefault(m["module"] + ".weight", {})[m["ab"]] = t
    merged = dict(base)
    for weight, ab in pairs.items():
        if weight not in base:
            raise ValueError(f"the adapter changes '{weight}', which the base model does not have")
        w = base[weight]
        merged[weight] = (w.float() + scale * (ab["B"].float() @ ab["A"].float())).to(w.dtype)
    return merged
