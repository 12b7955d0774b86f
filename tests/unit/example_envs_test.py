"""The example environments shipped in environments/: their rewards, datasets and configs."""

from pathlib import Path

import pytest
import reverse_text
import sum_digits

from prime_rl.config.cli import parse_config
from prime_rl.rl.config import RLConfig
from prime_rl.trainer.config import SFTConfig

REPO = Path(__file__).resolve().parents[2]


def reply(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_reverse_text_gives_partial_credit():
    assert reverse_text.reversal_reward(reply("cba"), "cba") == 1.0
    assert reverse_text.reversal_reward(reply("cxa"), "cba") == pytest.approx(2 / 3)
    assert reverse_text.reversal_reward(reply(""), "cba") == 0.0
    assert reverse_text.reversal_reward([], "cba") == 0.0  # a failed rollout has no messages


def test_sum_digits_is_exact_match_with_a_separate_format_metric():
    assert sum_digits.correct_answer(reply("<answer>12</answer>"), "12") == 1.0
    assert sum_digits.correct_answer(reply("<answer>13</answer>"), "12") == 0.0
    assert sum_digits.correct_answer(reply("12"), "12") == 0.0  # the format is part of the task
    assert sum_digits.answer_format(reply("<answer>13</answer>")) == 1.0
    assert sum_digits.answer_format(reply("so <answer>12</answer>")) == 0.0
    assert sum_digits.correct_answer([], "12") == 0.0 and sum_digits.answer_format([]) == 0.0


def test_sum_digits_dataset_is_seeded_and_correct():
    a = sum_digits.make_examples(50, seed=3, min_digits=2, max_digits=3)
    assert a == sum_digits.make_examples(50, seed=3, min_digits=2, max_digits=3)
    assert all(2 <= len(r["question"]) <= 3 and int(r["answer"]) == sum(map(int, r["question"])) for r in a)
    with pytest.raises(ValueError, match="min_digits"):
        sum_digits.load_environment(min_digits=0)


@pytest.mark.parametrize("env", ["reverse_text", "sum_digits"])
def test_example_configs_parse(env):
    rl = parse_config(RLConfig, ["@", str(REPO / "configs" / env / "rl.toml")])
    sft = parse_config(SFTConfig, ["@", str(REPO / "configs" / env / "sft.toml")])
    # RL starts from the model the documented SFT command saves.
    assert Path(rl.model) == Path(sft.save_dir)
    assert (REPO / rl.model / "config.json").is_file()
