"""Reward functions as plugins (`[[orchestrator.envs.rewards]]`): a user's function from an import
path with its kwargs, and the built-in `length`, land in the rollouts' rewards by their weights; a
path that does not load, kwargs the function does not take and the old `reward_model` key stop at
start-up with one line naming the key; --help lists the built-ins."""

import inspect
from pathlib import Path
from types import SimpleNamespace

import pytest
from bad_input_test import assert_clear_error, run_until_error
from config_test import parse_error
from custom_rewards import answer_bonus, chars_over, group_rank
from orchestrator_test import make_config, rollouts, run

from fake_server import FakeServer, Reply, tokenizer, user_text
from helpers.scripted import play
from prime_rl.config.cli import parse_config
from prime_rl.environments import EnvError
from prime_rl.launcher.config import RLConfig
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs.load import load_env
from prime_rl.orchestrator.envs.rewards import RewardRunner
from prime_rl.orchestrator.envs.scoring import Hook
from prime_rl.orchestrator.envs_config import EnvConfig, RewardsConfig
from prime_rl.orchestrator.rewards import bind
from prime_rl.orchestrator.rewards.length import length


def dapo(n: int, max_tokens: int, buffer: int) -> float:
    """DAPO's soft overlong punishment, written out case by case as the paper states it."""
    if n <= max_tokens - buffer:
        return 0.0
    if n <= max_tokens:
        return ((max_tokens - buffer) - n) / buffer
    return -1.0


def test_length_is_0_up_to_the_soft_zone_then_falls_linearly_to_minus_1_at_max_tokens():
    def trace(n: int):  # the trace's sampled tokens, over all turns
        return SimpleNamespace(num_output_tokens=n)

    scores = {n: length(trace(n), max_tokens=10, buffer=4) for n in range(0, 13)}
    assert scores == {n: dapo(n, 10, 4) for n in range(0, 13)}
    assert [scores[n] for n in (6, 7, 8, 9, 10, 11)] == [0.0, -0.25, -0.5, -0.75, -1.0, -1.0]


@pytest.mark.parametrize("env_workers", [0, 1], ids=["in-process", "env-workers"])
def test_custom_and_builtin_reward_functions_add_to_the_reward_by_their_weights(tmp_path, env_workers):
    def script(req, i):  # the answer's first letter, then 0-3 "+" (and 0-3 more per choice of a group)
        return Reply(text=user_text(req)[::-1][:1] + "+" * (i % 4))

    rewards = [
        {"type": "custom_rewards:chars_over", "weight": 0.5, "kwargs": {"limit": 2, "per_char": 0.25}},
        {
            "type": "custom_rewards:answer_bonus",
            "weight": 2.0,
            "kwargs": {"bonus": 0.5},
            "name": "starts_right",
        },
        {"type": "length", "max_tokens": 4, "buffer": 2},
    ]
    with FakeServer(script, distinct_choices=True) as server:
        config = make_config(tmp_path, server, env_workers=env_workers, max_steps=1, filters=[], envs=[
            {"id": "reverse-text", "group_size": 4, "sampling": {"max_tokens": 16}, "state_columns": ["answer"],
             "rewards": rewards}
        ])  # fmt: skip
        run(config)
    recs = rollouts(config, 0)
    assert len(recs) >= 8 and not any(r["error"] for r in recs)
    for r in recs:
        text, m = r["completion"][-1]["content"], r["metrics"]
        assert m["chars_over"] == 0.25 * max(0, len(text) - 2)
        assert m["starts_right"] == (0.5 if text[0] == r["answer"][0] else 0.0) == 0.5
        assert m["length"] == dapo(len(tokenizer().encode(text)) + 1, 4, 2)  # + the end-of-turn token
        own = m["reversal_reward"]
        assert r["reward"] == pytest.approx(
            own + 0.5 * m["chars_over"] + 2.0 * m["starts_right"] + m["length"]
        )
    assert {0.0, -0.5, -1.0} <= {r["metrics"]["length"] for r in recs}  # before, in and past the soft zone


def test_bound_kwargs_keep_the_argument_matching_and_group_detection():
    funcs = [
        bind(chars_over, {"limit": 1}, "chars_over"),
        bind(answer_bonus, {"bonus": 3.0, "answer": "ignored"}, "bonus"),  # a bound value wins
        bind(group_rank, {"scale": 2.0}, "rank"),
    ]
    assert [list(inspect.signature(f).parameters) for f in funcs] == [["completion", "per_char"], ["completion", "kwargs"],
                                                                     ["completions"]]  # fmt: skip
    assert [Hook(f, f.__name__, "reward").group for f in funcs] == [False, False, True]
    assert inspect.iscoroutinefunction(funcs[1]) and not inspect.iscoroutinefunction(funcs[0])
    rewards = [
        {"type": "custom_rewards:chars_over", "kwargs": {"limit": 1}},
        {"type": "custom_rewards:answer_bonus", "kwargs": {"bonus": 3.0}, "name": "bonus"},
        {"type": "custom_rewards:group_rank", "kwargs": {"scale": 2.0}, "weight": 0.5, "name": "rank"},
    ]
    env = load_env(EnvConfig(id="reverse-text", rewards=rewards), rewards=RewardRunner(RewardsConfig()))
    assert env.group_scoring  # a group function: the group is scored together
    model = str(Path(__file__).parents[2] / "models" / "reverse_text-tiny")
    _, task = play("reverse-text", ["ab"], model, env=env.vf_env)
    answer = task.data.answer
    replies = [answer[0] + "xxxxxxx", answer[0], "?" + answer]
    rollouts, _ = play("reverse-text", replies, model, size=3, env=env.vf_env, merge=False)
    lengths = [len(r.completion[0]["content"]) for r in rollouts]
    assert sorted(lengths) == [1, 1 + len(answer), 8] and len(set(lengths)) == 3
    assert sorted(r.metrics["bonus"] for r in rollouts) == [0.0, 3.0, 3.0]  # two start as the answer does
    assert [r.metrics["rank"] for r in rollouts] == [2.0 * sorted(lengths).index(n) for n in lengths]
    for r in rollouts:
        m = r.metrics
        assert r.reward == pytest.approx(
            m["reversal_reward"] + m["chars_over"] + m["bonus"] + 0.5 * m["rank"]
        )


def test_two_functions_with_one_name_are_refused_unless_named():
    same = {"type": "custom_rewards:chars_over", "kwargs": {"limit": 1}}
    with pytest.raises(
        EnvError, match=r"envs\[0\].rewards\[1\]: the env already has a reward or metric named 'chars_over'"
    ):
        load_env(EnvConfig(id="reverse-text", rewards=[same, same]))
    env = load_env(EnvConfig(id="reverse-text", rewards=[same, {**same, "name": "chars_over_2"}]))
    assert [h.name for h in env.vf_env.scorer.extra] == ["chars_over", "chars_over_2"]
    own = {**same, "name": "reversal_reward"}  # nor may one take the name of the env's own reward
    with pytest.raises(EnvError, match="already has a reward or metric named 'reversal_reward'"):
        load_env(EnvConfig(id="reverse-text", rewards=[own]))


@pytest.mark.parametrize(
    ("reward", "phrases"),
    [
        ('{type = "no_such_module:fn"}',
         ["orchestrator.envs[0].rewards[0].type = 'no_such_module:fn'", "cannot import 'no_such_module'"]),
        ('{type = "custom_rewards:missing", weight = 0.5}',
         ["orchestrator.envs[0].rewards[0].type = 'custom_rewards:missing'", "no function 'missing'"]),
        ('{type = "custom_rewards:chars_over", kwargs = {limt = 2}}',
         ["orchestrator.envs[0].rewards[0].kwargs = {'limt': 2}", "takes no argument(s) ['limt']"]),
    ],
)  # fmt: skip
def test_a_reward_function_that_does_not_load_stops_rl_with_one_line_naming_the_key(
    tmp_path, reward, phrases
):
    out = run_until_error(
        "rl", "--orchestrator.envs", f'[{{id = "reverse-text", rewards = [{reward}]}}]', cwd=tmp_path
    )
    assert_clear_error(out, 2, *phrases)
    assert len([line for line in out.stderr.splitlines() if "error:" in line]) == 1


def test_the_old_reward_model_key_says_where_it_went(tmp_path, capsys):
    toml = tmp_path / "rm.toml"
    toml.write_text(
        '[[orchestrator.envs]]\nid = "reverse-text"\n[orchestrator.envs.reward_model]\npath = "rm"\n'
    )
    err = parse_error(RLConfig, ["@", str(toml)], capsys)
    assert "'orchestrator.envs[0].reward_model' (from " in err and "is gone" in err
    assert '[[orchestrator.envs.rewards]] with type = "reward_model"' in err
    err = parse_error(
        OrchestratorConfig, ["--envs", '[{id = "reverse-text", reward_model = {url = "u"}}]'], capsys
    )
    assert "'envs[0].reward_model' (from --envs) is gone" in err


def test_help_lists_the_reward_functions_and_their_settings(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_config(RLConfig, ["--help"], prog="rl")
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "orchestrator.envs[].rewards[].type reward_model | length | STR" in out
    for setting in ("weight", "path", "env_reward_weight", "max_tokens", "buffer", "kwargs"):
        assert f"orchestrator.envs[].rewards[].{setting} " in out, setting


def test_a_shipped_config_uses_the_new_key():
    config = parse_config(RLConfig, ["@", str(Path(__file__).parents[2] / "configs/sum_digits/rl.toml"), "@",
                                     str(Path(__file__).parents[2] / "configs/sum_digits/rl_reward_model.toml")])  # fmt: skip
    (reward,) = config.orchestrator.envs[0].rewards
    assert (reward.type, reward.path, reward.env_reward_weight) == (
        "reward_model",
        "models/sum_digits-rm",
        0.0,
    )
