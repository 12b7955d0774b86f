"""SFT: chat examples from a JSONL or an env, loss on completion tokens only, a saved HF model."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.trainer.sft.config import SFTConfig, SFTDataConfig
from prime_rl.trainer.sft.main import SFTDataError, read_examples, run_sft, tokenize


def test_completion_is_exactly_what_the_template_adds(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = [{"role": "user", "content": "abc"}]
    s = tokenize(tok, prompt, [{"role": "assistant", "content": "cba"}], "x")
    assert tok.decode(s.prompt_ids) == "<|im_start|>user\nabc<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(s.completion_ids) == "cba<|im_end|>\n"
    assert s.completion_mask == [1] * len(s.completion_ids)


def test_completion_is_tokenized_as_generated_after_the_prompt(tiny_model):
    # The tiny tokenizer merges "\n<" into one token: as one text, the completion's first character
    # would be glued to the prompt's last token, which no generation ever produces.
    tok = AutoTokenizer.from_pretrained(tiny_model)
    prompt = [{"role": "user", "content": "876"}]
    s = tokenize(tok, prompt, [{"role": "assistant", "content": "<answer>21</answer>"}], "x")
    assert s.prompt_ids == tok.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
    assert tok.decode(s.completion_ids) == "<answer>21</answer><|im_end|>\n"


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


def test_answer_format_wraps_an_env_answer_into_the_completion():
    data = SFTDataConfig(env_id="sum-digits", answer_format="<answer>{answer}</answer>", num_examples=3)
    for prompt, completion, *_ in read_examples(data):
        number = prompt[-1]["content"]
        assert completion == [{"role": "assistant", "content": f"<answer>{sum(map(int, number))}</answer>"}]


def test_answer_format_without_the_answer_is_rejected():
    with pytest.raises(ValueError, match="answer_format"):
        SFTDataConfig(env_id="sum-digits", answer_format="<answer></answer>")


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


class Crash(Exception):
    pass


def sft_config(tiny_model, tmp_path, data, name: str, **over) -> SFTConfig:
    fields = dict(model={"name": str(tiny_model)}, output_dir=str(tmp_path / name), max_steps=6, batch_size=3,
                  seq_len=64, optim={"lr": 3e-3}, data={"path": str(data)})  # fmt: skip
    return SFTConfig(**{**fields, **over})


@pytest.fixture
def words(tmp_path):
    data = tmp_path / "data.jsonl"
    rows = [
        {"prompt": w, "completion": w[::-1]} for w in ("abc", "hello", "xyz", "prime", "rl", "tokens", "q")
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    return data


def test_an_sft_run_stopped_after_a_checkpoint_resumes_and_ends_as_an_uninterrupted_one(
    tiny_model, tmp_path, words, monkeypatch
):
    """Through the trainers' one loop: the checkpoint holds the model, optimizer, schedule and where
    the sample stream stands, so the resumed run trains steps 4 and 5 on the samples the whole run
    did and saves the same weights."""
    from safetensors.torch import load_file

    from prime_rl.trainer.sft.objective import SFT

    whole = run_sft(sft_config(tiny_model, tmp_path, words, "whole"))
    real_step, steps, crash = SFT.train_step, [], [True]

    def crash_at_step_4(self, micro_batches, step=0):
        steps.append(step)
        if step == 4 and crash[0]:
            raise Crash
        return real_step(self, micro_batches, step)

    monkeypatch.setattr(SFT, "train_step", crash_at_step_4)
    with pytest.raises(Crash):
        run_sft(sft_config(tiny_model, tmp_path, words, "stopped", ckpt={"interval": 2}))
    steps.clear()
    crash[0] = False
    resumed = run_sft(
        sft_config(tiny_model, tmp_path, words, "stopped", ckpt={"interval": 2, "resume_step": -1})
    )
    assert steps == [4, 5]
    a, b = load_file(whole / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_sft_resume_with_another_batch_size_goes_on_from_the_samples_the_checkpoint_consumed(
    tiny_model, tmp_path, words, monkeypatch
):
    """The data position is the checkpoint's (12 samples after 4 steps of 3), not the new batch size
    times the step (4 x 5 = 20), which would skip samples no step trained on."""
    import prime_rl.trainer.sft.main as sft_main

    run_sft(sft_config(tiny_model, tmp_path, words, "run", max_steps=4, ckpt={"interval": 2}))
    starts = []
    real = sft_main.sample_stream
    monkeypatch.setattr(
        sft_main, "sample_stream", lambda s, seed, start: starts.append(start) or real(s, seed, start)
    )
    run_sft(sft_config(tiny_model, tmp_path, words, "run", max_steps=5, batch_size=5,
                       ckpt={"interval": 2, "resume_step": -1}))  # fmt: skip
    assert starts == [12]
