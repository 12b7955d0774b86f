"""The example environments shipped in environments/: their rewards, datasets and configs."""

import json
from pathlib import Path

import digit_sum_feedback
import pytest
import reverse_text
import sum_digits

from helpers.scripted import play
from prime_rl.config.cli import parse_config
from prime_rl.environments import EnvError, load_v1_env
from prime_rl.launcher.config import RLConfig
from prime_rl.trainer.sft.config import SFTConfig

REPO = Path(__file__).resolve().parents[2]


MODELS = REPO / "models"


def reward(env: str, replies: list[str], **args) -> tuple[float, dict]:
    """The reward and metrics of a rollout of `env`'s first task whose model says `replies`."""
    (rollout,), _ = play(env, replies, str(MODELS / "reverse_text-tiny"), **args)
    assert not rollout.failed, rollout.error
    return rollout.reward, rollout.metrics


def test_reverse_text_gives_partial_credit():
    (_rollout,), task = play("reverse-text", ["?"], str(MODELS / "reverse_text-tiny"))
    answer = task.data.answer
    assert reward("reverse-text", [answer])[0] == 1.0
    assert reward("reverse-text", ["x" + answer[1:]])[0] == pytest.approx(1 - 1 / len(answer))
    assert reward("reverse-text", [""])[0] == 0.0
    assert reverse_text.lcs_ratio("cxa", "cba") == pytest.approx(2 / 3)


def test_sum_digits_is_exact_match_with_a_separate_format_metric():
    _, task = play("sum-digits", ["?"], str(MODELS / "reverse_text-tiny"))
    right, wrong = task.data.answer, str(int(task.data.answer) + 1)
    assert reward("sum-digits", [f"<answer>{right}</answer>"]) == (
        1.0,
        {"answer_format": 1.0, "correct_answer": 1.0},
    )
    assert reward("sum-digits", [f"<answer>{wrong}</answer>"]) == (
        0.0,
        {"answer_format": 1.0, "correct_answer": 0.0},
    )
    assert reward("sum-digits", [right])[0] == 0.0  # the format is part of the task
    assert reward("sum-digits", [f"so <answer>{right}</answer>"]) == (
        1.0,
        {"answer_format": 0.0, "correct_answer": 1.0},
    )


def test_digit_sum_feedback_rewards_the_first_right_answer_by_its_turn():
    _, task = play("digit-sum-feedback", ["?"], str(MODELS / "reverse_text-tiny"))
    a = task.data.answer

    def game(*answers):
        return reward("digit-sum-feedback", [f"<answer>{x}</answer>" for x in answers])

    assert game(a) == (1.0, {"feedback_reward": 1.0, "first_turn_correct": 1.0, "solved": 1.0})
    assert game(a - 2, a) == (0.5, {"feedback_reward": 0.5, "first_turn_correct": 0.0, "solved": 1.0})
    assert game(a - 2, a - 1, a)[0] == 0.25
    assert game(a - 2, a - 1, a + 1, a) == (
        0.0,
        {"feedback_reward": 0.0, "first_turn_correct": 0.0, "solved": 0.0},
    )
    (rollout,), _ = play("digit-sum-feedback", ["<answer>0</answer>"], str(MODELS / "reverse_text-tiny"))
    assert len(rollout.turns) == 3 and not rollout.is_truncated  # the game ends after the third try


def test_tool_add_calls_its_tool_and_rewards_the_sum():
    _, task = play("tool-add", ["?"], str(MODELS / "tool_add-tiny"))
    a, b = task.data.a, task.data.b
    args = json.dumps({"a": a, "b": b})
    call = f'<tool_call>\n{{"name": "add", "arguments": {args}}}\n</tool_call>'
    (rollout,), _ = play("tool-add", [call, f"<answer>{a + b}</answer>"], str(MODELS / "tool_add-tiny"))
    assert rollout.reward == 1.0 and rollout.metrics["called_with_the_numbers"] == 1.0
    assert rollout.tool_calls == 1 and rollout.tool_errors == 0
    assert [m["role"] for m in rollout.completion] == ["assistant", "tool", "assistant"]
    assert rollout.completion[1]["content"] == str(a + b)
    # A call with a wrong argument comes back as an error the model reads.
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "c": 2}}\n</tool_call>'
    (rollout,), _ = play("tool-add", [bad, "<answer>3</answer>"], str(MODELS / "tool_add-tiny"))
    assert rollout.tool_errors == 1 and rollout.completion[1]["content"].startswith("Error:")


def test_code_add_runs_the_models_program_and_rewards_the_sum():
    model = str(MODELS / "code_add-tiny")
    _, task = play("code-add", ["?"], model)
    a, b = task.data.a, task.data.b
    code = json.dumps({"code": f"print({a} + {b})"})
    call = f'<tool_call>\n{{"name": "python", "arguments": {code}}}\n</tool_call>'
    (rollout,), _ = play("code-add", [call, f"<answer>{a + b}</answer>"], model)
    assert rollout.reward == 1.0 and rollout.metrics["printed_the_sum"] == 1.0
    assert rollout.completion[1]["content"] == str(a + b)
    # A program that fails comes back as its error's last line; the answer still scores.
    broken = json.dumps({"code": "print(1 +)"})
    call = f'<tool_call>\n{{"name": "python", "arguments": {broken}}}\n</tool_call>'
    (rollout,), _ = play("code-add", [call, "<answer>0</answer>"], model)
    assert rollout.tool_errors == 1 and "SyntaxError" in rollout.completion[1]["content"]
    assert rollout.reward == 0.0 and rollout.metrics["printed_the_sum"] == 0.0


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
    with pytest.raises(EnvError, match="min_digits"):
        load_v1_env("sum-digits", {"min_digits": 0})


@pytest.mark.parametrize("env", ["reverse_text", "sum_digits", "digit_sum_feedback", "tool_add", "code_add"])
def test_example_configs_parse(env):
    rl = parse_config(RLConfig, ["@", str(REPO / "configs" / env / "rl.toml")])
    sft = parse_config(SFTConfig, ["@", str(REPO / "configs" / env / "sft.toml")])
    # RL starts from the model the documented SFT command saves.
    assert Path(rl.model) == Path(sft.save_dir)
    assert (REPO / rl.model / "config.json").is_file()
