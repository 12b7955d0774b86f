"""Check a model name that points at a local folder before any process starts loading it.

A name is taken as local when it starts with '/', '.' or '~', has more than one '/', or exists:
hub ids are 'name' or 'org/name'. Only local names are checked; a hub id is left to the loader.

Invariant: a local folder that passes `check_model_name` has a config.json that is a JSON object
with a `model_type`, and its context length is read from that file alone (plain JSON, no
transformers or vLLM import), by the rule vLLM applies when it derives `max_model_len`; two local
folders' tokenizers are compared from their tokenizer.json files alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "model_max_length",
    "max_target_positions",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
"""Config keys vLLM reads the model's context length from; it takes the smallest one present."""

PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
"""RoPE types whose max_position_embeddings already includes the scaling (vLLM leaves it as is)."""


def is_local(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or Path(name).expanduser().exists()


def check_model_name(name: str) -> str:
    """Return `name`, or raise ValueError saying what is wrong with the local folder it names."""
    if not is_local(name):
        return name
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"no model folder at '{name}' (resolved: {path.resolve()}); give a local HF folder "
            "(config.json, safetensors weights, tokenizer), e.g. one made by `make-tiny-model`"
        )
    if not (path / "config.json").exists():
        raise ValueError(f"'{name}' is a folder but not an HF model: it has no config.json")
    read_config(name)
    return name


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"'{path}' is not valid JSON: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"'{path}' cannot be read: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"'{path}' must hold a JSON object, not {type(data).__name__}")
    return data


def read_config(name: str) -> dict[str, Any] | None:
    """A local model's config.json as a dict (None for a hub id); ValueError if it is not a model config."""
    if not is_local(name):
        return None
    path = Path(name).expanduser() / "config.json"
    config = _read_json(path)
    if not isinstance(config.get("model_type"), str):
        raise ValueError(f"'{path}' has no 'model_type', so transformers cannot tell which model it is")
    return config


def num_experts(name: str) -> int:
    """Experts per layer of a local mixture-of-experts model (0: dense, or not a local folder)."""
    config = read_config(name) or {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return int(text.get("num_experts") or text.get("num_local_experts") or 0)


def _rope_factor(config: dict[str, Any]) -> float:
    # Gemma3's max_position_embeddings is already scaled: vLLM special-cases it the same way.
    if "gemma3" in config.get("model_type", ""):
        return 1.0
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    per_layer = [v for v in rope.values() if isinstance(v, dict)] or [rope]
    factor = 1.0
    for params in per_layer:
        if params.get("rope_type", params.get("type")) not in PRESCALED_ROPE:
            factor = params.get("factor") or factor
    return float(factor)


def max_model_len(name: str) -> tuple[int, str] | None:
    """The longest sequence a local model allows and the key it comes from (None if unknown).

    As vLLM derives it: the smallest of the length keys of the (text) config, scaled by a RoPE
    factor, capped by the tokenizer's model_max_length.
    """
    config = read_config(name)
    if config is None:
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    found = [(text[k], k) for k in LENGTH_KEYS if isinstance(text.get(k), int) and text[k] > 0]
    if not found:
        return None
    length, key = min(found)
    if any(k == "model_max_length" for _, k in found):
        length, key = text["model_max_length"], "model_max_length"  # Command-R: vLLM lets it win
    length, key = int(length * _rope_factor(text)), f"{key} in its config.json"
    tokenizer = Path(name).expanduser() / "tokenizer_config.json"
    if tokenizer.is_file():
        try:
            cap = _read_json(tokenizer).get("model_max_length")
        except ValueError:
            cap = None  # the tokenizer is the loader's business; this is only a cap
        if isinstance(cap, int) and 0 < cap < length:
            length, key = cap, "model_max_length in its tokenizer_config.json"
    return length, key


def tokenizer_mismatch(student: str, teacher: str) -> str | None:
    """Why two local model folders' tokenizers differ (vocabulary, merges or special tokens), from
    their tokenizer files alone; None when they agree or either is not a local folder."""
    a, b = Path(student).expanduser(), Path(teacher).expanduser()
    if not (a / "tokenizer.json").is_file() or not (b / "tokenizer.json").is_file():
        return None
    try:
        ta, tb = (json.loads((p / "tokenizer.json").read_text()) for p in (a, b))
    except (OSError, json.JSONDecodeError) as e:
        return f"its tokenizer.json cannot be read: {e}"
    vocab_a, vocab_b = ta.get("model", {}).get("vocab", {}), tb.get("model", {}).get("vocab", {})
    if vocab_a != vocab_b:
        return f"its vocabulary ({len(vocab_b)} tokens) differs from the student's ({len(vocab_a)} tokens)"
    added = [[(t.get("id"), t.get("content")) for t in x.get("added_tokens", [])] for x in (ta, tb)]
    if added[0] != added[1] or ta.get("model", {}).get("merges") != tb.get("model", {}).get("merges"):
        return "its special tokens or merges differ from the student's"
    return None
