"""`load_tokenizer` gives what `AutoTokenizer` gives (class, ids, chat template) for every shipped
model and the tiny model, without importing torch for the ones it loads directly; anything it
cannot vouch for goes to `AutoTokenizer`."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from prime_rl.model.tokenizer import DIRECT_MODEL_TYPES, direct_class, load_tokenizer

MODELS = Path(__file__).parents[2] / "models"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "reverse: abc"},
    {"role": "assistant", "content": "cba"},
    {"role": "user", "content": "again"},
]


@pytest.mark.parametrize(
    "folder", sorted(p.name for p in MODELS.iterdir() if (p / "tokenizer.json").exists())
)
def test_each_shipped_model_loads_as_auto_tokenizer_loads_it(folder):
    from transformers import AutoTokenizer

    name = str(MODELS / folder)
    ours, auto = load_tokenizer(name), AutoTokenizer.from_pretrained(name)
    assert type(ours) is type(auto)
    assert ours.encode("hello world, 12 + 34") == auto.encode("hello world, 12 + 34")
    assert ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == (
        auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    )
    assert (ours.eos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.pad_token_id)


def test_the_tiny_model_is_loaded_directly_without_torch(tiny_model):
    assert direct_class(str(tiny_model)) is not None
    code = (
        "import sys; from prime_rl.model.tokenizer import load_tokenizer; "
        f"t = load_tokenizer({str(tiny_model)!r}); print(type(t).__name__, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["TokenizersBackend", "False"]


def test_what_auto_tokenizer_would_load_otherwise_is_left_to_it(tmp_path):
    from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

    # transformers substitutes its own class for these model types: never loaded directly.
    assert not set(DIRECT_MODEL_TYPES) & MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    source = MODELS / "reverse_text-tiny"
    for change in ({"config": {"model_type": "qwen2"}}, {"tokenizer": {"auto_map": {"AutoTokenizer": ["x", "y"]}}},
                   {"tokenizer": {"tokenizer_class": "Qwen2Tokenizer"}}):  # fmt: skip
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(source, folder)
        for kind, keys in change.items():
            path = folder / ("config.json" if kind == "config" else "tokenizer_config.json")
            path.write_text(json.dumps({**json.loads(path.read_text()), **keys}))
        assert direct_class(str(folder)) is None, change
    assert direct_class("Qwen/Qwen3-0.6B") is None  # a hub id: AutoTokenizer's
