"""Loss aggregation: each mode's per-token weights and global divisor give its formula on a batch
spread over several micro-batches, and two data-parallel ranks (with context parallelism too)
train like one."""

import random
import sys
from pathlib import Path

import pytest
import torch

from prime_rl.trainer.batch import sample_index
from prime_rl.trainer.losses.aggregation import divisor, token_weights

sys.path.insert(0, str(Path(__file__).parent))
from trainer_grad_test import run_workers

# On one xdist worker, which computes the module fixtures (shared by the training tests) once.
pytestmark = pytest.mark.xdist_group("aggregation")

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def reference(mode: str, samples: list[tuple[list[float], list[bool]]], norm: float) -> float:
    """The mode's formula over (token losses, loss mask) per sample."""
    kept = [[x for x, m in zip(losses, mask, strict=True) if m] for losses, mask in samples]
    kept = [k for k in kept if k]  # samples without a loss token do not count
    if mode == "token-mean":
        return sum(map(sum, kept)) / sum(map(len, kept))
    if mode == "seq-mean-token-sum":
        return sum(map(sum, kept)) / len(kept)
    if mode == "seq-mean-token-mean":
        return sum(sum(k) / len(k) for k in kept) / len(kept)
    return sum(sum(k) / norm for k in kept) / len(kept)


@pytest.mark.parametrize("mode", MODES)
def test_weights_and_divisor_give_the_formula(mode):
    rng = random.Random(MODES.index(mode))
    samples = []
    for _ in range(11):
        n = rng.randint(1, 9)
        samples.append(([rng.uniform(-2, 2) for _ in range(n)], [rng.random() < 0.7 for _ in range(n)]))
    samples.append(([0.5, 0.5], [False, False]))  # a prompt-only sample: no loss token
    micro_batches = [samples[:4], samples[4:9], samples[9:]]
    tokens = sum(sum(m) for _, m in samples)
    counted = sum(1 for _, m in samples if any(m))
    total = 0.0
    for mb in micro_batches:
        losses = torch.tensor([x for s, _ in mb for x in s], dtype=torch.float64)
        mask = torch.tensor([x for _, m in mb for x in m])
        w = token_weights(
            mode, [sum(m) for _, m in mb], sample_index([len(s) for s, _ in mb], mask.device), 37.0
        )
        total += float(((losses * mask) * (1 if w is None else w)).sum())
    got = total / divisor(mode, tokens, counted)
    assert got == pytest.approx(reference(mode, samples, 37.0), rel=1e-6)


@pytest.fixture(scope="module")
def one_rank_by_mode(tiny_model, tmp_path_factory) -> dict[str, dict]:
    """One rank's output for each mode, from one process."""
    folder = tmp_path_factory.mktemp("agg")
    runs = [(folder / f"{m}.pt", 0, f"agg={m}") for m in MODES]
    return dict(zip(MODES, run_workers(tiny_model, 1, *runs), strict=True))


@pytest.fixture(scope="module")
def dp2_by_cp2_by_mode(tiny_model, tmp_path_factory) -> dict[str, dict]:
    """4 ranks' output (2 replicas of 2 cp ranks, 5 and 7 samples) for each mode but token-mean, from
    one launch."""
    folder = tmp_path_factory.mktemp("agg4")
    runs = [(folder / f"{m}.pt", 5, f"agg={m}", "cp=2") for m in MODES[1:]]
    return dict(zip(MODES[1:], run_workers(tiny_model, 4, *runs), strict=True))


def test_the_modes_train_differently(one_rank_by_mode):
    name = "lm_head.weight"
    grads = [one_rank_by_mode[m]["grads"][name] for m in MODES]
    for i in range(len(grads)):
        for j in range(i):
            assert not torch.allclose(grads[i], grads[j], rtol=1e-3), (MODES[i], MODES[j])


@pytest.mark.parametrize("mode", MODES[1:])
def test_dp2_by_cp2_aggregates_like_one_rank(one_rank_by_mode, dp2_by_cp2_by_mode, mode):
    """4 ranks (2 replicas of 2 cp ranks, 5 and 7 samples): the global sample count and each
    sample's token count are the one rank's, so are the gradients."""
    one, four = one_rank_by_mode[mode], dp2_by_cp2_by_mode[mode]
    for name, g in one["grads"].items():
        assert g.abs().max() > 0, name
        torch.testing.assert_close(four["grads"][name], g, rtol=1e-4, atol=1e-6, msg=f"gradient of {name}")
