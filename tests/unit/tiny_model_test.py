"""The project's own tiny model: deterministic, and loadable by transformers with a ChatML template."""

import hashlib
import json

import pydantic
import pytest
import torch
from safetensors import safe_open
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


def turn_extends(tok, before: list[dict], reply: dict, after: list[dict], tools=None) -> bool:
    """Whether the prompt after `reply` starts with the prompt before it plus the reply's tokens as
    the model would sample them (its own text tokenized alone, then the end-of-turn token)."""
    p1 = tok.apply_chat_template(before, tools=tools, add_generation_prompt=True, return_dict=False)
    full = tok.apply_chat_template([*before, reply], tools=tools, tokenize=False)
    p1_text = tok.apply_chat_template(before, tools=tools, add_generation_prompt=True, tokenize=False)
    sampled = tok(full[len(p1_text) :].removesuffix("\n"), add_special_tokens=False)["input_ids"]
    p2 = tok.apply_chat_template(
        [*before, reply, *after], tools=tools, add_generation_prompt=True, return_dict=False
    )
    return p2[: len(p1) + len(sampled)] == p1 + sampled


def test_a_conversation_re_renders_to_the_tokens_sampled_turn_by_turn(tiny_model):
    # Content starting with punctuation: "\n<" must not merge at the message boundary.
    tok = AutoTokenizer.from_pretrained(tiny_model)
    before = [{"role": "system", "content": "S"}, {"role": "user", "content": "343"}]
    reply = {"role": "assistant", "content": "<answer>11</answer>"}
    assert turn_extends(tok, before, reply, [{"role": "user", "content": "Too high."}])


def test_tools_calls_and_results_render_and_re_render_exactly(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert all(
        len(tok(t, add_special_tokens=False)["input_ids"]) == 1 for t in ["<tool_call>", "</tool_response>"]
    )
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two integers.",
              "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]  # fmt: skip
    before = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "2 + 3"}]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}  # fmt: skip
    result = {"role": "tool", "tool_call_id": "c", "content": "5"}
    text = tok.apply_chat_template(
        [*before, call, result], tools=tools, add_generation_prompt=True, tokenize=False
    )
    assert "add(a: integer, b: integer) - Add two integers." in text
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in text
    assert turn_extends(tok, before, call, [result], tools=tools)
    # Without tools the template is plain ChatML.
    plain = tok.apply_chat_template(before, add_generation_prompt=True, tokenize=False)
    assert (
        plain
        == "<|im_start|>system\nUse tools.<|im_end|>\n<|im_start|>user\n2 + 3<|im_end|>\n<|im_start|>assistant\n"
    )


def test_the_real_vocab_preset_has_qwen3s_vocabulary_and_every_id_decodes(tmp_path):
    folder = make_tiny_model(
        TinyModelConfig(
            output=tmp_path / "rv",
            preset="real-vocab",
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            num_kv_heads=1,
            corpus_lines=300,
        )
    )
    tok = AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["vocab_size"] == len(tok) == 151_936 and config["hidden_size"] == 32  # flags win
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    assert None not in tokens and len(set(tokens)) == len(tokens)  # no hole, no duplicate
    assert tok.convert_tokens_to_ids("<tool_call>") < 600  # added tokens keep their ids
    text = "Reverse the text: abc <tool_call>"
    ids = tok(text)["input_ids"]
    assert max(ids) < 600 and tok.decode(ids) == text  # text never encodes to reserved tokens
    assert tok.decode([151_935]) == "<|reserved_151935|>"


def test_the_qwen3_0_6b_preset_has_its_shape():
    config = TinyModelConfig(preset="qwen3-0.6b")
    assert (config.model_vocab_size, config.hidden_size, config.num_layers, config.head_dim) == (
        151_936,
        1024,
        28,
        128,
    )
    assert config.tie_word_embeddings and config.num_kv_heads == 8


def test_the_tiny_moe_preset_is_a_qwen3_moe_that_routes_each_token_to_two_of_eight_experts(tmp_path):
    folder = make_tiny_model(TinyModelConfig(output=tmp_path / "moe", preset="tiny-moe", corpus_lines=500))
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    experts = model.model.layers[0].mlp.experts
    assert tuple(experts.gate_up_proj.shape) == (8, 2 * 96, 128) and tuple(experts.down_proj.shape) == (
        8,
        128,
        96,
    )
    out = model(input_ids=torch.tensor([[5, 6, 7, 8]]), output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].shape == (4, 8)
    assert model.config.num_experts_per_tok == 2 and model.config.norm_topk_prob
    # Checkpoints hold one tensor per expert (the layout vLLM and the hub use).
    with safe_open(folder / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in names


def test_the_qwen3_30b_a3b_preset_has_its_shape_and_top_k_must_fit_the_experts():
    config = TinyModelConfig(preset="qwen3-30b-a3b")
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.hidden_size) == (
        128, 8, 768, 2048,
    )  # fmt: skip
    with pytest.raises(pydantic.ValidationError, match="num_experts_per_tok"):
        TinyModelConfig(num_experts=2, num_experts_per_tok=3)
