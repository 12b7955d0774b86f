"""The example environments shipped in environments/: their rewards, datasets and configs."""

from pathlib import Path

import digit_sum_feedback
import pytest
import reverse_text
import sum_digits

from prime_rl.config.cli import parse_config
from prime_rl.rl.config import RLConfig
from prime_rl.trainer.sft.config import SFTConfig

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


def test_digit_sum_feedback_rewards_the_first_right_answer_by_its_turn():
    def game(*answers):
        out = []
        for a in answers:
            out += [
                {"role": "assistant", "content": f"<answer>{a}</answer>"},
                {"role": "user", "content": "x"},
            ]
        return out[:-1]

    reward = digit_sum_feedback.make_reward([1.0, 0.5, 0.25])
    assert reward(game(12), "12") == 1.0
    assert reward(game(10, 12), "12") == 0.5
    assert reward(game(10, 11, 12), "12") == 0.25
    assert reward(game(10, 11, 13), "12") == 0.0
    assert reward([], "12") == 0.0  # a failed rollout has no messages
    assert digit_sum_feedback.solved(game(10, 12), "12") == 1.0
    assert digit_sum_feedback.first_turn_correct(game(10, 12), "12") == 0.0


def test_digit_sum_feedback_replies_with_the_direction_or_the_format():
    assert digit_sum_feedback.feedback(10, 12) == "Too low."
    assert digit_sum_feedback.feedback(13, 12) == "Too high."
    assert digit_sum_feedback.feedback(None, 12) == digit_sum_feedback.FORMAT_HINT
    assert digit_sum_feedback.feedback(12, 12) is None


def test_digit_sum_feedback_sft_games_end_right_and_follow_the_feedback():
    from digit_sum_feedback.transcripts import transcripts

    rows = transcripts(200, seed=0)
    assert rows == transcripts(200, seed=0)
    lengths = {len(r["messages"]) for r in rows}
    assert lengths == {3, 5, 7}  # solved at once, after one wrong answer, after two
    for row in rows:
        msgs = row["messages"]
        answer = sum(map(int, msgs[1]["content"]))
        assert msgs[-1] == {"role": "assistant", "content": f"<answer>{answer}</answer>"}
        for said, heard in zip(msgs[2:-1:2], msgs[3:-1:2], strict=True):
            guess = digit_sum_feedback.parse_answer(said["content"])
            assert guess != answer and heard["content"] == digit_sum_feedback.feedback(guess, answer)


def test_sum_digits_dataset_is_seeded_and_correct():
    a = sum_digits.make_examples(50, seed=3, min_digits=2, max_digits=3)
    assert a == sum_digits.make_examples(50, seed=3, min_digits=2, max_digits=3)
    assert all(2 <= len(r["question"]) <= 3 and int(r["answer"]) == sum(map(int, r["question"])) for r in a)
    with pytest.raises(ValueError, match="min_digits"):
        sum_digits.load_environment(min_digits=0)


@pytest.mark.parametrize("env", ["reverse_text", "sum_digits", "digit_sum_feedback", "tool_add"])
def test_example_configs_parse(env):
    rl = parse_config(RLConfig, ["@", str(REPO / "configs" / env / "rl.toml")])
    sft = parse_config(SFTConfig, ["@", str(REPO / "configs" / env / "sft.toml")])
    # RL starts from the model the documented SFT command saves.
    assert Path(rl.model) == Path(sft.save_dir)
    assert (REPO / rl.model / "config.json").is_file()


def test_the_v1_example_config_parses_and_plays_on_the_classic_games_model():
    rl = parse_config(RLConfig, ["@", str(REPO / "configs" / "digit_sum_feedback_v1" / "rl.toml")])
    classic = parse_config(RLConfig, ["@", str(REPO / "configs" / "digit_sum_feedback" / "rl.toml")])
    assert rl.model == classic.model and rl.orchestrator.envs[0].id == "digit-sum-feedback-v1"
