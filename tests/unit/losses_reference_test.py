"""Every built-in loss against its paper's formula, written here token by token (scalar torch ops, so
autograd gives the reference gradient), on random micro-batches: 1 to 8 samples of 1 to 9 tokens,
loss masks with gaps (multi-turn), tied advantages, ratios of exactly 1 and ratios far outside every
band. Values and gradients within 1e-5."""

import math
import random

import pytest
import torch

from prime_rl.trainer.losses import LossInputs, build_loss
from prime_rl.trainer.losses.config import CISPOLoss, CPGDLoss, DPPOLoss, DualClipLoss, PPOLoss, SAPOLoss

WIDE = {"mask_low": 0.0, "mask_high": 1e9}  # the frame's trust masks out of the way: the formula alone


def batch(seed: int):
    """(sampling logprobs, trainer logprobs, advantages, loss mask, sample lengths) as Python lists."""
    rng = random.Random(seed)
    lens = [rng.randint(1, 9) for _ in range(rng.randint(1, 8))]
    sampling, trainer, adv, mask = [], [], [], []
    for n in lens:
        a = rng.choice([-1.5, -0.3, 0.0, 0.7, 2.0])  # few values: ties across samples
        gap = rng.randrange(n)  # a multi-turn gap (env tokens) inside the sample
        for i in range(n):
            s = -rng.uniform(0.05, 4.0)
            kind = rng.random()
            if kind < 0.2:
                t = s  # ratio exactly 1
            elif kind < 0.3:
                t = s + rng.choice([-3.0, 3.0])  # far outside every band
            else:
                t = s + rng.gauss(0, 0.3)
            sampling.append(s)
            trainer.append(min(t, -1e-3))
            adv.append(a)
            mask.append(not (n > 2 and gap <= i < gap + 2))
    return sampling, trainer, adv, mask, lens


def run(config, data):
    sampling, trainer, adv, mask, lens = data
    lp = torch.tensor(trainer, dtype=torch.float64, requires_grad=True)
    out = build_loss(config)(
        LossInputs(
            lp,
            torch.tensor(sampling, dtype=torch.float64),
            torch.tensor(adv, dtype=torch.float64),
            torch.tensor(mask),
            torch.ones(len(trainer), dtype=torch.float64),
            lens,
        )
    )
    out.token_loss.sum().backward()
    return out.token_loss.detach(), lp.grad


def reference(formula, data):
    """Per-token losses of `formula(trainer logprob (a 0-d tensor), sampling logprob, advantage)` on
    the masked tokens (0 elsewhere), and the gradient of their sum."""
    sampling, trainer, adv, mask, _ = data
    lp = torch.tensor(trainer, dtype=torch.float64, requires_grad=True)
    losses = [formula(lp[i], sampling[i], adv[i]) if mask[i] else lp[i] * 0 for i in range(len(trainer))]
    total = torch.stack(losses)
    total.sum().backward()
    return total.detach(), lp.grad


def ppo_formula(lo, hi):
    def f(lp, s, a):
        r = torch.exp(lp - s)
        return -torch.min(r * a, torch.clamp(r, 1 - lo, 1 + hi) * a)

    return f


def dual_clip_formula(lo, hi, c):
    def f(lp, s, a):
        surrogate = -ppo_formula(lo, hi)(lp, s, a)  # min(r A, clip(r) A)
        return -torch.max(surrogate, torch.tensor(c * a, dtype=torch.float64)) if a < 0 else -surrogate

    return f


def cispo_formula(lo, hi):
    def f(lp, s, a):
        w = min(max(math.exp(lp.item() - s), 1 - lo), 1 + hi)  # a number: its gradient is stopped
        return -w * a * lp

    return f


def sapo_formula(tau_pos, tau_neg):
    def f(lp, s, a):
        tau = tau_pos if a > 0 else tau_neg
        r = torch.exp(lp - s)
        return -(4 / tau) * torch.sigmoid(tau * (r - 1)) * a

    return f


def dppo_formula(delta_low, delta_high, kl_tau):
    def f(lp, s, a):
        p, q = math.exp(lp.item()), math.exp(s)
        masked = (a > 0 and p - q > delta_high) or (a <= 0 and p - q < -delta_low)
        pg = 0 if masked else torch.exp(lp - s) * a
        return -pg + kl_tau * (lp - s) ** 2

    return f


def cpgd_formula(lo, hi, drift):
    def f(lp, s, a):
        lr = lp - s
        clipped = torch.clamp(lr, math.log(1 - lo), math.log(1 + hi))
        return -torch.min(lr * a, clipped * a) + drift * (torch.exp(lr) - 1 - lr)

    return f


CASES = {
    "ppo": (PPOLoss(**WIDE), ppo_formula(0.2, 0.28)),
    "dual_clip": (DualClipLoss(**WIDE, clip_c=2.0), dual_clip_formula(0.2, 0.28, 2.0)),
    "cispo": (CISPOLoss(**WIDE), cispo_formula(1.0, 4.0)),
    "cispo_bounded": (CISPOLoss(**WIDE, clip_low=0.2, clip_high=0.28), cispo_formula(0.2, 0.28)),
    "sapo": (SAPOLoss(**WIDE), sapo_formula(1.0, 1.05)),
    "dppo": (DPPOLoss(**WIDE), dppo_formula(0.2, 0.2, 1e-3)),
    "dppo_tight": (
        DPPOLoss(**WIDE, delta_low=0.01, delta_high=0.02, kl_tau=0.5),
        dppo_formula(0.01, 0.02, 0.5),
    ),
    "cpgd": (CPGDLoss(**WIDE), cpgd_formula(0.2, 0.28, CPGDLoss().drift_coef)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("seed", range(6))
def test_each_loss_is_its_formula(name, seed):
    config, formula = CASES[name]
    data = batch(seed)
    values, grad = run(config, data)
    ref_values, ref_grad = reference(formula, data)
    torch.testing.assert_close(values, ref_values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)
    assert grad.abs().sum() > 0  # the case trains something


def test_cispo_keeps_a_gradient_where_ppo_clips():
    """A token with A > 0 whose ratio is above PPO's band: PPO gives it no gradient, CISPO does."""
    data = ([-1.0], [-1.0 + math.log(1.5)], [1.0], [True], [1])
    assert run(PPOLoss(**WIDE), data)[1].item() == 0.0
    assert run(CISPOLoss(**WIDE), data)[1].item() < 0.0  # the loss falls as log pi rises


def corrected(formula, kind: str, data, cap=2.0, low=0.5, high=2.0):
    """`formula` under a rollout correction, written out: TIS multiplies by min(r, cap) (a number,
    its gradient stopped); IcePop zeroes tokens with r outside [low, high]; the sequence mask zeroes
    the samples whose geometric-mean ratio over their loss tokens is outside it."""
    sampling, trainer, _, mask, lens = data
    ratio = [math.exp(t - s) for t, s in zip(trainer, sampling, strict=True)]
    sample_of = [i for i, n in enumerate(lens) for _ in range(n)]
    geo = []
    for i in range(len(lens)):
        logs = [math.log(ratio[k]) for k in range(len(trainer)) if sample_of[k] == i and mask[k]]
        geo.append(math.exp(sum(logs) / len(logs)) if logs else 1.0)
    position = iter(range(len(trainer)))

    def f(lp, s, a):
        k = next(position)
        while not mask[k]:  # `reference` calls the formula on loss tokens only
            k = next(position)
        if kind == "tis":
            return formula(lp, s, a) * min(ratio[k], cap)
        if kind == "icepop" and not low <= ratio[k] <= high:
            return lp * 0
        if kind == "seq_mask" and not low <= geo[sample_of[k]] <= high:
            return lp * 0
        return formula(lp, s, a)

    return f


@pytest.mark.parametrize("kind", ["tis", "icepop", "seq_mask"])
@pytest.mark.parametrize("loss", ["ppo", "cispo"])
@pytest.mark.parametrize("seed", range(4))
def test_each_rollout_correction_composes_with_the_loss(kind, loss, seed):
    from prime_rl.trainer.losses.config import RolloutCorrectionConfig

    config, formula = CASES[loss]
    data = batch(seed)
    sampling, trainer, adv, mask, lens = data
    lp = torch.tensor(trainer, dtype=torch.float64, requires_grad=True)
    fn = build_loss(config, correction=RolloutCorrectionConfig(type=kind))
    out = fn(LossInputs(lp, torch.tensor(sampling, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64),
                        torch.tensor(mask), torch.ones(len(trainer), dtype=torch.float64), lens))  # fmt: skip
    out.token_loss.sum().backward()
    ref_values, ref_grad = reference(corrected(formula, kind, data), data)
    torch.testing.assert_close(out.token_loss.detach(), ref_values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp.grad, ref_grad, rtol=1e-5, atol=1e-5)
    ratio = torch.exp(
        torch.tensor(trainer, dtype=torch.float64) - torch.tensor(sampling, dtype=torch.float64)
    )
    m = torch.tensor(mask)
    torch.testing.assert_close(out.values["is_ratio"][m], ratio[m])
    if kind != "tis":
        assert out.masks["correction_dropped"].any() or seed  # the bounds bite on some batches


def test_the_effective_sample_size_is_logged_per_env():
    from prime_rl.trainer.parallel.dist import World
    from prime_rl.trainer.stats import TokenStats

    stats = TokenStats()
    w = torch.tensor([1.0, 2.0, 4.0, 0.5, 0.5])
    rows = stats.rows(["a", "a", "a", "b", "b"])
    stats.add("is_ratio", rows, w, torch.tensor([True, True, True, True, False]))
    out = stats.reduce(World())
    assert out["is_ratio/a/ess"] == pytest.approx(7.0**2 / (3 * 21.0))
    assert out["is_ratio/b/ess"] == pytest.approx(1.0)
    assert out["is_ratio/all/ess"] == pytest.approx(7.5**2 / (4 * 21.25))


def test_the_entropy_bonus_subtracts_coef_times_the_entropy_of_kept_tokens():
    sampling, trainer, adv, mask, lens = batch(3)
    entropy = torch.rand(len(trainer), dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(torch.tensor(trainer, dtype=torch.float64), torch.tensor(sampling, dtype=torch.float64),
                        torch.tensor(adv, dtype=torch.float64), torch.tensor(mask), entropy, lens)  # fmt: skip
    plain = build_loss(PPOLoss(**WIDE))(inputs).token_loss
    out = build_loss(PPOLoss(**WIDE, entropy_coef=0.01))(inputs)
    m = torch.tensor(mask)
    torch.testing.assert_close(out.token_loss, torch.where(m, plain - 0.01 * entropy, 0.0))
    out.token_loss.sum().backward()
    torch.testing.assert_close(entropy.grad, torch.where(m, -0.01, 0.0).double())
