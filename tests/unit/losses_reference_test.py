"""Every built-in loss against its paper's formula, written here token by token (scalar torch ops, so
autograd gives the reference gradient), on random micro-batches: 1 to 8 samples of 1 to 9 tokens,
loss masks with gaps (multi-turn), tied advantages, ratios of exactly 1 and ratios far outside every
band. Values and gradients within 1e-5. Each formula is written against a base policy: the sampler
(`old_policy = 'sampler'`), or pi_old (the decoupled objective, here a pi_old that differs from the
trainer's policy, as on a step's later mini-batches); then the rollout correction reads pi_old / mu.
Last, the minimal inputs on which the frame once disagreed with its own docstring."""

import math
import random

import pytest
import torch

from prime_rl.trainer.losses import LossInputs, build_loss
from prime_rl.trainer.losses.config import CISPOLoss, CPGDLoss, DPPOLoss, DualClipLoss, PPOLoss, SAPOLoss

WIDE = {"mask_low": 0.0, "mask_high": 1e9}  # the frame's trust masks out of the way: the formula alone


def batch(seed: int):
    """(sampling logprobs, trainer logprobs, advantages, loss mask, sample lengths, old logprobs) as
    Python lists; pi_old lies between the sampler and the trainer."""
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
    old = [t + rng.gauss(0, 0.2) * (rng.random() < 0.7) for t in trainer]
    return sampling, trainer, adv, mask, lens, [min(o, -1e-3) for o in old]


def base_of(data, old_policy: str) -> list[float]:
    """The logprobs the loss's ratio divides by."""
    return data[0] if old_policy == "sampler" else data[5]


def inputs_of(data, old_policy: str, lp: torch.Tensor) -> LossInputs:
    sampling, trainer, adv, mask, lens, old = data
    return LossInputs(
        lp,
        torch.tensor(sampling, dtype=torch.float64),
        torch.tensor(adv, dtype=torch.float64),
        torch.tensor(mask),
        torch.ones(len(trainer), dtype=torch.float64),
        lens,
        old_logprobs=torch.tensor(old, dtype=torch.float64) if old_policy == "trainer" else None,
    )


def run(config, data, correction=None):
    lp = torch.tensor(data[1], dtype=torch.float64, requires_grad=True)
    out = build_loss(config, correction=correction)(inputs_of(data, config.old_policy, lp))
    out.token_loss.sum().backward()
    return out.token_loss.detach(), lp.grad


def reference(formula, data, old_policy: str = "sampler"):
    """Per-token losses of `formula(trainer logprob (a 0-d tensor), base logprob, advantage)` on the
    masked tokens (0 elsewhere), and the gradient of their sum."""
    _, trainer, adv, mask, _, _ = data
    base = base_of(data, old_policy)
    lp = torch.tensor(trainer, dtype=torch.float64, requires_grad=True)
    losses = [formula(lp[i], base[i], adv[i]) if mask[i] else lp[i] * 0 for i in range(len(trainer))]
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
    "ppo": (PPOLoss, {}, ppo_formula(0.2, 0.28)),
    "dual_clip": (DualClipLoss, {"clip_c": 2.0}, dual_clip_formula(0.2, 0.28, 2.0)),
    "cispo": (CISPOLoss, {}, cispo_formula(1.0, 4.0)),
    "cispo_bounded": (CISPOLoss, {"clip_low": 0.2, "clip_high": 0.28}, cispo_formula(0.2, 0.28)),
    "sapo": (SAPOLoss, {}, sapo_formula(1.0, 1.05)),
    "dppo": (DPPOLoss, {}, dppo_formula(0.2, 0.2, 1e-3)),
    "dppo_tight": (
        DPPOLoss,
        {"delta_low": 0.01, "delta_high": 0.02, "kl_tau": 0.5},
        dppo_formula(0.01, 0.02, 0.5),
    ),
    "cpgd": (CPGDLoss, {}, cpgd_formula(0.2, 0.28, CPGDLoss().drift_coef)),
}


def case(name: str, old_policy: str):
    cls, kwargs, formula = CASES[name]
    return cls(**WIDE, **kwargs, old_policy=old_policy), formula


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("old_policy", ["sampler", "trainer"])
@pytest.mark.parametrize("seed", range(4))
def test_each_loss_is_its_formula(name, old_policy, seed):
    config, formula = case(name, old_policy)
    data = batch(seed)
    values, grad = run(config, data)
    ref_values, ref_grad = reference(formula, data, old_policy)
    torch.testing.assert_close(values, ref_values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)
    assert grad.abs().sum() > 0  # the case trains something


def test_cispo_keeps_a_gradient_where_ppo_clips():
    """A token with A > 0 whose ratio is above PPO's band: PPO gives it no gradient, CISPO does."""
    data = ([-1.0], [-1.0 + math.log(1.5)], [1.0], [True], [1], [-1.0])
    assert run(case("ppo", "sampler")[0], data)[1].item() == 0.0
    assert run(case("cispo", "sampler")[0], data)[1].item() < 0.0  # the loss falls as log pi rises


def corrected(formula, kind: str, data, old_policy: str, cap=2.0, low=0.5, high=2.0):
    """`formula` under a rollout correction, written out on the behaviour ratio beta = pi_old / mu
    (pi_old: the trainer's policy at the step's start; the trainer's own without a separate one): TIS
    multiplies by min(beta, cap) (a number, its gradient stopped); IcePop zeroes tokens with beta
    outside [low, high]; the sequence mask zeroes the samples whose geometric-mean beta over their
    loss tokens is outside it."""
    sampling, trainer, _, mask, lens, old = data
    start = old if old_policy == "trainer" else trainer
    beta = [math.exp(o - s) for o, s in zip(start, sampling, strict=True)]
    sample_of = [i for i, n in enumerate(lens) for _ in range(n)]
    geo = []
    for i in range(len(lens)):
        logs = [math.log(beta[k]) for k in range(len(trainer)) if sample_of[k] == i and mask[k]]
        geo.append(math.exp(sum(logs) / len(logs)) if logs else 1.0)
    position = iter(range(len(trainer)))

    def f(lp, base, a):
        k = next(position)
        while not mask[k]:  # `reference` calls the formula on loss tokens only
            k = next(position)
        if kind == "tis":
            return formula(lp, base, a) * min(beta[k], cap)
        if kind == "icepop" and not low <= beta[k] <= high:
            return lp * 0
        if kind == "seq_mask" and not low <= geo[sample_of[k]] <= high:
            return lp * 0
        return formula(lp, base, a)

    return f


@pytest.mark.parametrize(
    "kind,old_policy",
    [
        ("tis", "trainer"),
        ("icepop", "trainer"),
        ("seq_mask", "trainer"),
        ("icepop", "sampler"),
        ("seq_mask", "sampler"),
    ],
)
@pytest.mark.parametrize("loss", ["ppo", "cispo"])
@pytest.mark.parametrize("seed", range(4))
def test_each_rollout_correction_composes_with_the_loss(kind, old_policy, loss, seed):
    from prime_rl.trainer.losses.config import RolloutCorrectionConfig

    config, formula = case(loss, old_policy)
    data = batch(seed)
    values, grad = run(config, data, RolloutCorrectionConfig(type=kind))
    ref_values, ref_grad = reference(corrected(formula, kind, data, old_policy), data, old_policy)
    torch.testing.assert_close(values, ref_values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-5)


def one_sample(trainer, sampling, adv, config, correction=None):
    """(token losses, gradient, outputs) of `config` on one sample of loss tokens, in the step's first
    mini-batch (pi_old is the trainer's own policy)."""
    lp = torch.tensor(trainer, dtype=torch.float64, requires_grad=True)
    n = len(trainer)
    out = build_loss(config, correction=correction)(
        LossInputs(
            lp,
            torch.tensor(sampling, dtype=torch.float64),
            torch.tensor(adv, dtype=torch.float64),
            torch.ones(n, dtype=torch.bool),
            torch.ones(n, dtype=torch.float64),
            [n],
        )
    )
    out.token_loss.sum().backward()
    return out.token_loss.detach(), lp.grad, out


@pytest.mark.parametrize("old_policy", ["trainer", "sampler"])
def test_the_sequence_mask_averages_the_true_log_ratios(old_policy):
    """One sample of 16 tokens, A = 1: one sampled at -100 where the trainer says -0.1 (log beta =
    99.9), fifteen with log beta = -2. The geometric mean exp(69.9 / 16) = 79 is above high = 2, so the
    whole sample is dropped. (Clamping each log-ratio to +-30 before the mean gave exactly 1, kept.)"""
    from prime_rl.trainer.losses.config import RolloutCorrectionConfig

    trainer, sampling = [-0.1] + [-2.5] * 15, [-100.0] + [-0.5] * 15
    values, grad, out = one_sample(
        trainer,
        sampling,
        [1.0] * 16,
        PPOLoss(old_policy=old_policy),
        RolloutCorrectionConfig(type="seq_mask"),
    )
    assert out.masks["correction_dropped"].all()
    assert values.abs().sum() == 0 and grad.abs().sum() == 0


@pytest.mark.parametrize("ratio_type", ["token", "sequence"])
def test_dppo_tests_each_tokens_own_probability_change(ratio_type):
    """One sample, A = 1, sampler q = (0.3, 0.9), trainer p = (0.6, 0.45): token 1 rose by 0.3 >
    delta_high, so its policy-gradient term is masked, whatever the ratio. (With the sequence ratio,
    1 here, p was once taken as q * 1 and token 1 stayed trusted: loss -1 instead of its penalty.)"""
    tau = DPPOLoss().kl_tau
    values, _, out = one_sample(
        [math.log(0.6), math.log(0.45)], [math.log(0.3), math.log(0.9)], [1.0, 1.0],
        DPPOLoss(**WIDE, ratio_type=ratio_type, old_policy="sampler"),
    )  # fmt: skip
    assert out.masks["dppo_masked_high"].tolist() == [True, False]
    assert values[0].item() == pytest.approx(tau * math.log(2.0) ** 2)  # the penalty alone


@pytest.mark.parametrize("ratio,adv,want", [(1.2, 1.0, -1.2), (1.5, 1.0, -1.5), (0.6, -1.0, 0.6)])
def test_tis_weights_the_decoupled_loss_once(ratio, adv, want):
    """PPO + TIS, C = 2, beta = pi_old / mu = `ratio`: the token's loss is -min(beta, C) A with the
    loss's own ratio pi / pi_old = 1, and so is its gradient. (With the ratio taken against the
    sampler, r min(r, C) A: -1.44, and 0 where PPO clipped r = 1.5 and r = 0.6.)"""
    from prime_rl.trainer.losses.config import RolloutCorrectionConfig

    values, grad, out = one_sample(
        [-0.5],
        [-0.5 - math.log(ratio)],
        [adv],
        PPOLoss(old_policy="trainer"),
        RolloutCorrectionConfig(type="tis", tis_cap=2.0),
    )
    assert values.item() == pytest.approx(want)
    assert grad.item() == pytest.approx(want)
    assert out.values["is_ratio"].item() == pytest.approx(ratio)  # what the ESS is computed from


def test_tis_with_the_sampler_as_old_policy_is_refused_naming_both_keys():
    from pydantic import ValidationError

    from prime_rl.trainer.config import TrainerConfig

    with pytest.raises(
        ValidationError, match=r"loss.old_policy = 'sampler'.*rollout_correction.type = 'tis'"
    ):
        TrainerConfig(loss={"old_policy": "sampler"}, rollout_correction={"type": "tis"})


def test_cispo_under_its_preset_keeps_a_token_far_outside_the_trust_masks():
    """Ratio 10 (above mask_high = 8), A = 1: CISPO's gradient is -clip(10) A = -5 under the shipped
    preset; PPO's trust mask would drop the token."""
    import tomllib
    from pathlib import Path

    from prime_rl.trainer.config import TrainerConfig

    preset = tomllib.loads((Path(__file__).parents[2] / "configs/algorithms/cispo.toml").read_text())
    config = TrainerConfig(loss=preset["trainer"]["loss"]).loss
    assert config.mask_high < 10
    _, grad, _ = one_sample([-0.5], [-0.5 - math.log(10.0)], [1.0], config)
    assert grad.item() == pytest.approx(-(1 + config.clip_high))
    _, grad, _ = one_sample([-0.5], [-0.5 - math.log(10.0)], [1.0], PPOLoss(old_policy="sampler"))
    assert grad.item() == 0.0


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
    sampling, trainer, adv, mask, lens, _ = batch(3)
    entropy = torch.rand(len(trainer), dtype=torch.float64, requires_grad=True)
    inputs = LossInputs(torch.tensor(trainer, dtype=torch.float64), torch.tensor(sampling, dtype=torch.float64),
                        torch.tensor(adv, dtype=torch.float64), torch.tensor(mask), entropy, lens)  # fmt: skip
    plain = build_loss(PPOLoss(**WIDE))(inputs).token_loss
    out = build_loss(PPOLoss(**WIDE, entropy_coef=0.01))(inputs)
    m = torch.tensor(mask)
    torch.testing.assert_close(out.token_loss, torch.where(m, plain - 0.01 * entropy, 0.0))
    out.token_loss.sum().backward()
    torch.testing.assert_close(entropy.grad, torch.where(m, -0.01, 0.0).double())
