"""SFT: chat examples from a JSONL or an env, loss on completion tokens only, a saved HF model."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.trainer.config import SFTConfig
from prime_rl.trainer.sft import SFTDataError, run_sft, tokenize


def test_completion_is_exactly_what_the_template_adds(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = [{"role": "user", "content": "abc"}]
    s = tokenize(tok, prompt, [{"role": "assistant", "content": "cba"}], "x")
    assert tok.decode(s.prompt_ids) == "<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(s.completion_ids) == "cba<|im_end|>\n"
    assert s.completion_mask == [1] * len(s.completion_ids)


def test_sft_learns_from_a_jsonl_and_saves_an_hf_model(tiny_model, tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [{"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": w[::-1]}]}
            for w in ("abc", "hello", "xyz", "prime")]  # fmt: skip
    rows.append({"prompt": "rl", "completion": "lr"})
    data.write_text("\n".join(json.dumps(r) for r in rows))
    config = SFTConfig(
        model={"name": str(tiny_model)}, output_dir=str(tmp_path / "out"), max_steps=8, batch_size=5, seq_len=64,
        optim={"lr": 3e-3}, data={"path": str(data)},
    )  # fmt: skip
    saved = run_sft(config)
    losses = [
        json.loads(line)["loss"]
        for line in (tmp_path / "out" / "sft" / "metrics.jsonl").read_text().splitlines()
    ]
    assert len(losses) == 8 and losses[-1] < losses[0] * 0.8
    model = AutoModelForCausalLM.from_pretrained(saved)
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert not torch.equal(model.lm_head.weight, start.lm_head.weight)
    assert AutoTokenizer.from_pretrained(saved).chat_template


def test_sft_from_an_env_dataset(tiny_model, tmp_path):
    config = SFTConfig(
        model={"name": str(tiny_model)}, output_dir=str(tmp_path / "out"), max_steps=2, batch_size=4, seq_len=128,
        data={"env_id": "reverse-text", "num_examples": 16},
    )  # fmt: skip
    assert (run_sft(config) / "model.safetensors").exists()


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"messages": [{"role": "user", "content": "x"}]}', "must end with assistant"),
        ('{"text": "x"}', "expected"),
        ("not json", "not JSON"),
    ],
)
def test_bad_sft_data_names_file_and_line(tiny_model, tmp_path, content, message):
    data = tmp_path / "bad.jsonl"
    data.write_text(content + "\n")
    config = SFTConfig(model={"name": str(tiny_model)}, output_dir=str(tmp_path), data={"path": str(data)})
    with pytest.raises(SFTDataError, match=message) as exc:
        run_sft(config)
    assert f"{data}:1" in str(exc.value)
