"""Built-in advantage functions and the validation every advantage function goes through."""

import math

import pytest

from prime_rl.orchestrator.advantages import (
    ADVANTAGES,
    Advantage,
    AdvantageError,
    AdvantageInputs,
    AdvantageOutputs,
    build_advantage,
)
from prime_rl.orchestrator.advantages.base import CustomAdvantage
from prime_rl.orchestrator.advantages.grpo import GRPOAdvantage
from prime_rl.orchestrator.advantages.reinforce_baseline import ReinforceBaselineAdvantage
from prime_rl.orchestrator.advantages.rloo import RLOOAdvantage
from prime_rl.orchestrator.rollout import Rollout


def group(*rewards: float) -> AdvantageInputs:
    return AdvantageInputs([Rollout("env", 7, 0, reward=r) for r in rewards], "env", 7)


def test_grpo_is_reward_minus_group_mean_optionally_std_normalized():
    assert build_advantage(GRPOAdvantage())(group(1, 0, 0, 1)).advantages == [0.5, -0.5, -0.5, 0.5]
    out = build_advantage(GRPOAdvantage(std_normalize=True))(group(1, 0, 0, 1)).advantages
    assert all(math.isclose(abs(a), 1.0, rel_tol=1e-5) for a in out)


def test_grpo_std_can_be_bessel_corrected():
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0]
    m = sum(rewards) / 5
    bessel = math.sqrt(sum((r - m) ** 2 for r in rewards) / 4)
    out = build_advantage(GRPOAdvantage(std_normalize=True, std_unbiased=True))(group(*rewards)).advantages
    assert out == pytest.approx([(r - m) / (bessel + 1e-6) for r in rewards], rel=1e-5)
    assert build_advantage(GRPOAdvantage(std_normalize=True, std_unbiased=True))(group(1.0)).advantages == [
        0.0
    ]


def test_rloo_uses_the_mean_of_the_others():
    assert build_advantage(RLOOAdvantage())(group(1, 0, 0)).advantages == [1.0, -0.5, -0.5]


def test_reinforce_baseline_is_the_group_mean_baseline_and_asks_the_trainer_to_whiten():
    fn = build_advantage(ReinforceBaselineAdvantage())
    assert fn(group(2, 0)).advantages == [1.0, -1.0]
    assert ReinforceBaselineAdvantage().expects_batch_normalization
    assert not any(
        b.config().expects_batch_normalization
        for n, b in ADVANTAGES.builtins.items()
        if n != "reinforce_baseline"
    )


def test_singleton_group_gets_zero_without_calling_the_function():
    def boom(inputs):
        raise RuntimeError("must not be called")

    adv = Advantage("boom", boom, {})
    assert adv(group(0.3)).advantages == [0.0]


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda inputs: AdvantageOutputs([0.0]), "returned 1 advantages for a group of 2"),
        (lambda inputs: AdvantageOutputs([math.inf, 0.0]), "non-finite advantages at positions \\[0\\]"),
        (lambda inputs: [0.0, 0.0], "returned list, expected AdvantageOutputs"),
        (lambda inputs: AdvantageOutputs(["x", 0.0]), "non-number"),
    ],
)
def test_bad_outputs_name_the_env_example_and_function(fn, message):
    with pytest.raises(AdvantageError, match=message) as exc:
        Advantage("my.module:fn", fn, {})(group(1, 0))
    assert (
        "'my.module:fn'" in str(exc.value) and "env 'env'" in str(exc.value) and "example 7" in str(exc.value)
    )


def test_custom_import_path_errors():
    with pytest.raises(AdvantageError, match="must look like"):
        build_advantage(CustomAdvantage(type="nodots:"))
    with pytest.raises(AdvantageError, match="cannot import"):
        build_advantage(CustomAdvantage(type="no_such_pkg.mod:fn"))
