"""The project's own tiny model: deterministic, and loadable by transformers with a ChatML template."""

import hashlib

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.model.tiny import TinyModelConfig, make_tiny_model


def digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_same_seed_same_files_other_seed_other_files(tmp_path):
    small = {"corpus_lines": 500}
    a = make_tiny_model(TinyModelConfig(output=tmp_path / "a", **small))
    b = make_tiny_model(TinyModelConfig(output=tmp_path / "b", **small))
    c = make_tiny_model(TinyModelConfig(output=tmp_path / "c", seed=1, **small))
    assert digest(a) == digest(b)
    assert digest(a)["model.safetensors"] != digest(c)["model.safetensors"]


def test_loads_in_transformers_with_chatml_and_untied_head(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert model.config.vocab_size >= len(tok)
    assert not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text  # byte-level BPE round-trips exactly
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()
