"""A model's tokenizer, loaded without importing torch where the model folder allows it.

`AutoTokenizer` resolves the tokenizer class through transformers' model configs, which import
torch and torch._dynamo: 3 s of CPU in each orchestrator and env worker, which use neither (a
test run starts some hundred of them). A local folder whose tokenizer_config.json names the
generic tokenizers backend (what transformers 5 saves for a tokenizer without a class of its own,
as `make-tiny-model`'s) is loaded with that class directly, for the model types where
`AutoTokenizer` keeps that class (`DIRECT_MODEL_TYPES`); everything else goes to `AutoTokenizer`.

Invariant: `load_tokenizer(name)` is a tokenizer of the class `AutoTokenizer.from_pretrained(name)`
picks, loaded from the same files by that class's own `from_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prime_rl.model.local import is_local

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
"""The generic backend's names in a tokenizer_config.json (the second is an alias of the first)."""

DIRECT_MODEL_TYPES = ("qwen3", "qwen3_moe")
"""Model types for which `AutoTokenizer` loads a folder that names the generic backend with that
backend (for some others, e.g. qwen2, it substitutes the model type's own class)."""


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def direct_class(name: str) -> str | None:
    """The generic class to load local folder `name` with, None when that is `AutoTokenizer`'s call."""
    if not is_local(name):
        return None
    folder = Path(name).expanduser()
    tokenizer_config = _json(folder / "tokenizer_config.json")
    cls = tokenizer_config.get("tokenizer_class")
    model_type = _json(folder / "config.json").get("model_type")
    if cls in GENERIC_CLASSES and "auto_map" not in tokenizer_config and model_type in DIRECT_MODEL_TYPES:
        return cls
    return None


def load_tokenizer(name: str):
    """The tokenizer of the model `name` (a folder or hub id)."""
    cls = direct_class(name)
    if cls is not None:
        import transformers

        return getattr(transformers, cls).from_pretrained(name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)
