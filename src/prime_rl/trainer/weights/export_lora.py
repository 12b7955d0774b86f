"""`uv run export-lora --adapter RUN/weights/step_N --output DIR`: fold a published LoRA adapter into
its base model and write a full HF model folder, which transformers and vLLM load without LoRA.

Invariant: the written model computes what the base model with the adapter applied computes
(W + (alpha / r) B A on every adapted layer, in float32, stored in the base model's dtype); every
other tensor, the config and the tokenizer are the base model's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pydantic import field_validator

from prime_rl.config import RootConfig, parse_config
from prime_rl.runtime.layout import READY
from prime_rl.trainer.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, merge


class ExportLoRAConfig(RootConfig):
    """export-lora: a published adapter folded into its base model, as a full model folder."""

    adapter: Path
    """A published adapter folder (`<output_dir>/weights/step_<N>`: adapter_config.json and
    adapter_model.safetensors)."""

    @field_validator("adapter")
    @classmethod
    def _is_an_adapter(cls, path: Path) -> Path:
        if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
            raise ValueError(f"'{path}' holds no LoRA adapter ({ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
        if not (path / READY).exists() and (path.parent.name == "weights"):
            raise ValueError(f"'{path}' has no {READY} marker: the trainer was still writing it")
        return path

    output: Path
    """Folder to write the merged model to (created; must not hold a model already)."""

    base: str | None = None
    """The base model (HF folder or hub id). Default: the one the adapter names
    (`base_model_name_or_path` in its adapter_config.json)."""


def export(config: ExportLoRAConfig) -> Path:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_config = json.loads((config.adapter / ADAPTER_CONFIG).read_text())
    base = config.base or adapter_config.get("base_model_name_or_path")
    if not base:
        raise SystemExit(
            f"export-lora: error: {config.adapter / ADAPTER_CONFIG} names no base model: give --base"
        )
    if (config.output / "config.json").exists():
        raise SystemExit(
            f"export-lora: error: '{config.output}' already holds a model: choose another --output"
        )
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto")  # the base's own dtype
    scale = float(adapter_config["lora_alpha"]) / float(adapter_config["r"])
    try:
        merged = merge(model.state_dict(), load_file(config.adapter / ADAPTER_WEIGHTS), scale)
    except ValueError as e:
        raise SystemExit(f"export-lora: error: {config.adapter} does not fit '{base}': {e}") from None
    model.load_state_dict(merged)
    config.output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(config.output)
    AutoTokenizer.from_pretrained(base).save_pretrained(config.output)
    return config.output


def main(argv: list[str] | None = None) -> None:
    config = parse_config(ExportLoRAConfig, argv, prog="export-lora")
    out = export(config)
    sys.stdout.write(f"export-lora: wrote the merged model to {out}\n")
