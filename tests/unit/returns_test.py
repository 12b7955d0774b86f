"""Token-level estimators against hand computations on a small packed micro-batch.

The micro-batch holds two samples. Sample A: 2 prompt tokens, then model, model, env, model.
Sample B: 1 prompt token, then model, model. The env token carries no reward and is skipped by the
discount.
"""

import math

import pytest
import torch

from prime_rl.trainer.estimators import TokenAdvantageError, TokenAdvantageInputs, build_estimator
from prime_rl.trainer.estimators.config import GAE, CustomEstimator, Reinforce
from prime_rl.trainer.estimators.returns import TokenGrid, discounted_returns, gae, terminal_rewards
from prime_rl.trainer.rl.kl_reward import KLController, kl_rewards

MASK = torch.tensor([0, 0, 1, 1, 0, 1, 0, 1, 1], dtype=torch.bool)
LENS = [6, 3]
MODEL = MASK.nonzero().squeeze(1).tolist()  # [2, 3, 5, 7, 8]


def on_model_tokens(values: list[float]) -> torch.Tensor:
    out = torch.zeros(len(MASK))
    out[MODEL] = torch.tensor(values, dtype=torch.float32)
    return out


def close(got: torch.Tensor, want: list[float]) -> None:
    torch.testing.assert_close(got, on_model_tokens(want), atol=1e-6, rtol=0)


def test_grid_places_model_tokens_per_sample():
    grid = TokenGrid.of(MASK, LENS)
    model = grid.mask.nonzero().squeeze(1)
    assert grid.rows[model].tolist() == [0, 0, 0, 1, 1] and grid.cols[model].tolist() == [0, 1, 2, 0, 1]
    assert (grid.cols[~grid.mask] == grid.width).all()  # other tokens park in the spare column
    assert grid.last_token().nonzero().squeeze(1).tolist() == [5, 8]
    close(terminal_rewards(grid, torch.tensor([1.0, 2.0])), [0, 0, 1, 0, 2])


def test_discounted_returns_by_hand():
    grid = TokenGrid.of(MASK, LENS)
    rewards = on_model_tokens([-0.1, -0.2, -0.3 + 1.0, -0.4, -0.5 + 2.0])
    # A: 0.7; -0.2 + 0.5 * 0.7 = 0.15; -0.1 + 0.5 * 0.15 = -0.025. B: 1.5; -0.4 + 0.75 = 0.35.
    close(discounted_returns(grid, rewards, gamma=0.5), [-0.025, 0.15, 0.7, 0.35, 1.5])


def test_gae_by_hand():
    grid = TokenGrid.of(MASK, LENS)
    rewards = on_model_tokens([0, 0, 1, 0, 2])
    values = on_model_tokens([0.2, 0.4, 0.6, 1.0, 1.2])
    advantages, returns = gae(grid, rewards, values, gamma=0.5, lam=0.5)
    # A: deltas (0.0, -0.1, 0.4) -> A = (0.0, 0.0, 0.4). B: deltas (-0.4, 0.8) -> A = (-0.2, 0.8).
    close(advantages, [0.0, 0.0, 0.4, -0.2, 0.8])
    close(returns, [0.2, 0.4, 1.0, 0.8, 2.0])
    # lambda = 1, gamma = 1: Monte-Carlo return minus value.
    advantages, returns = gae(grid, rewards, values, gamma=1.0, lam=1.0)
    close(advantages, [0.8, 0.6, 0.4, 1.0, 0.8])
    close(returns, [1, 1, 1, 2, 2])


def inputs(**kw) -> TokenAdvantageInputs:
    base = dict(
        loss_mask=MASK,
        sample_lens=LENS,
        rollout_advantages=torch.tensor([0.5] * 6 + [-0.5] * 3),
        rollout_rewards=torch.tensor([1.0, 2.0]),
        kl_rewards=torch.zeros(len(MASK)),
    )
    return TokenAdvantageInputs(**{**base, **kw})


def test_reinforce_with_gamma_one_hands_the_rollout_advantage_through():
    out = build_estimator(Reinforce())(inputs())
    close(out.advantages, [0.5, 0.5, 0.5, -0.5, -0.5])
    assert out.returns is None


def test_discounted_reinforce_with_kl_in_the_reward():
    est = build_estimator(Reinforce(gamma=0.5))
    kl = on_model_tokens([-0.1, -0.2, -0.3, -0.4, -0.5])
    out = est(inputs(kl_rewards=kl))
    # A: -0.3 + 0.5 = 0.2; -0.2 + 0.1 = -0.1; -0.1 - 0.05 = -0.15. B: -1.0; -0.4 - 0.5 = -0.9.
    close(out.advantages, [-0.15, -0.1, 0.2, -0.9, -1.0])


def test_gae_estimator_uses_rewards_and_values_not_the_rollout_advantage():
    est = build_estimator(GAE(gamma=0.5, lam=0.5))
    out = est(inputs(values=on_model_tokens([0.2, 0.4, 0.6, 1.0, 1.2])))
    close(out.advantages, [0.0, 0.0, 0.4, -0.2, 0.8])
    close(out.returns, [0.2, 0.4, 1.0, 0.8, 2.0])
    with pytest.raises(TokenAdvantageError, match="critic"):
        est(inputs())


def bad_estimator(inputs, **kw):
    from prime_rl.trainer.estimators import TokenAdvantageOutputs

    return TokenAdvantageOutputs(torch.full((3,), float("nan")))


def test_a_custom_estimator_is_checked():
    est = build_estimator(CustomEstimator(type="returns_test:bad_estimator"))
    with pytest.raises(TokenAdvantageError, match="shape"):
        est(inputs())


@pytest.mark.parametrize(
    ("estimator", "want"),
    [("k1", [0.5, -0.5]), ("k2", [0.125, 0.125]), ("k3", [math.exp(-0.5) - 0.5, math.exp(0.5) - 1.5])],
)
def test_kl_rewards_by_hand(estimator, want):
    sampling = torch.tensor([-1.0, -2.0, 0.0])
    ref = torch.tensor([-1.5, -1.5, -9.0])
    mask = torch.tensor([True, True, False])
    reward, kl = kl_rewards(sampling, ref, mask, beta=0.1, estimator=estimator)
    torch.testing.assert_close(kl, torch.tensor([*want, 0.0]))
    torch.testing.assert_close(reward, -0.1 * torch.tensor([*want, 0.0]))


def test_adaptive_kl_controller_by_hand():
    fixed = KLController(beta=0.1)
    assert fixed.update(5.0, 128) is fixed
    c = KLController(beta=0.1, target=1.0, horizon=256)
    assert math.isclose(c.update(1.1, 128).beta, 0.1 * (1 + 0.1 * 0.5))  # above target: beta up
    assert math.isclose(c.update(0.5, 128).beta, 0.1 * (1 - 0.2 * 0.5))  # error clipped at -0.2
    assert math.isclose(c.update(9.0, 128).beta, 0.1 * (1 + 0.2 * 0.5))  # and at +0.2
