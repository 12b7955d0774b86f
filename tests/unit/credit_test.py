"""Credit assignment across the wire: the orchestrator's terms travel apart and the trainer composes
them once, A_t = normalize(estimate_t) + d_t (`trainer/rl/credit.py`)."""

import math

import numpy as np
import pytest
import torch

from prime_rl.trainer.batch import PackedBatch
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.rl.credit import Credit, compose
from prime_rl.transport.messages import TrainingSample
from prime_rl.transport.packing import pack


def sample(env: str, adv: float, n: int, terms: list[float] | None = None) -> TrainingSample:
    return TrainingSample([1, 2], [3] * n, [1] * n, [-1.0] * n, advantage=adv, reward=0.0, env_name=env,
                          token_advantages=terms or [])  # fmt: skip


def credits(samples: list[TrainingSample], seq_len: int = 8) -> list[Credit]:
    """What the trainer builds from each packed micro-batch, before its estimator (gamma = 1: the
    estimate is the rollout advantage on the model tokens)."""
    out = []
    for mb in pack(samples, seq_len, 1, "r", 0)[0]:
        b = PackedBatch.of(mb, World())
        out.append(Credit(b, b.per_token(b.rollout_advantages) * b.loss_mask))
    return out


def per_env(items: list[Credit], advantages: list[torch.Tensor]) -> dict[str, list[float]]:
    got: dict[str, list[float]] = {}
    for c, a in zip(items, advantages, strict=True):
        b = c.batch
        ids = np.repeat(np.arange(len(b.sample_lens)), b.sample_lens)[b.loss_mask.numpy()]
        for i, v in zip(ids, a[b.loss_mask].tolist(), strict=True):
            got.setdefault(b.env_names[i], []).append(v)
    return got


def whiten(xs: list[float]) -> list[float]:
    m = sum(xs) / len(xs)
    std = math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
    return [(x - m) / (std + 1e-6) for x in xs]


def test_normalization_all_pools_the_model_tokens_of_every_micro_batch():
    samples = [sample("a", 2.0, 2), sample("a", 0.0, 1), sample("b", 1.0, 3)]
    items = credits(samples)
    assert len(items) > 1  # the pool spans micro-batches
    got = per_env(items, compose(items, "all", World()))
    tokens = {"a": [2.0, 2.0, 0.0], "b": [1.0, 1.0, 1.0]}
    pooled = whiten(tokens["a"] + tokens["b"])  # per token, not per rollout: REINFORCE++'s whitening
    assert sorted(got["a"] + got["b"]) == pytest.approx(sorted(pooled), abs=1e-5)
    assert items[0].estimate.sum() != 0 and all(torch.equal(c.estimate, c0.estimate) for c, c0 in
                                                zip(items, credits(samples), strict=True))  # inputs unchanged  # fmt: skip


def test_normalization_per_env_keeps_the_envs_apart():
    samples = [sample("a", 1.0, 2), sample("a", 3.0, 2), sample("b", 10.0, 1), sample("b", 20.0, 3)]
    items = credits(samples)
    got = per_env(items, compose(items, "env", World()))
    # a: tokens (1, 1, 3, 3) -> mean 2, std 1; b: tokens (10, 20, 20, 20) -> mean 17.5, std 4.33
    assert sorted(got["a"]) == pytest.approx([-1, -1, 1, 1], abs=1e-5)
    std_b = math.sqrt((7.5**2 + 3 * 2.5**2) / 4)
    assert sorted(got["b"]) == pytest.approx([-7.5 / std_b] + [2.5 / std_b] * 3, abs=1e-5)


def test_per_token_terms_are_added_after_normalization_so_their_weight_holds():
    samples = [sample("a", 1.0, 2, terms=[0.5, -0.5]), sample("a", -1.0, 2)]
    items = credits(samples, seq_len=16)
    (composed,) = compose(items, "all", World())
    mask = items[0].batch.loss_mask
    # whitened rollout advantages are +-1 (to within eps); the teacher's terms ride on top unscaled
    assert composed[mask].tolist() == pytest.approx([1.5, 0.5, -1.0, -1.0], abs=1e-5)
    (plain,) = compose(items, "none", World())
    assert plain[mask].tolist() == pytest.approx([1.5, 0.5, -1.0, -1.0])
    assert (composed[~mask] == 0).all()


def test_a_micro_batch_without_per_token_terms_carries_none():
    (item,) = credits([sample("a", 1.0, 2)], seq_len=16)
    assert item.batch.token_advantages is None


@pytest.mark.parametrize("mode", ["env", "all"])
def test_a_step_of_filler_only_whitens_nothing_and_does_not_crash(mode):
    """Every rollout of the step filtered: a rank gets only filler micro-batches (no real sample,
    no loss token). Per-env whitening once indexed a 0-row moments tensor here."""
    (mb,) = pack([], 8, 1, "r", 0)[0]
    assert mb.filler
    items = [Credit(PackedBatch.of(mb, World()), torch.zeros(mb.num_tokens))]
    (out,) = compose(items, mode, World())
    assert torch.equal(out, torch.zeros(mb.num_tokens))
