"""The loss normalization contract: one global batch gives the same gradients on 1 rank and on 2
ranks (gloo, FSDP2), however unevenly its tokens are split between the ranks."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = str(Path(__file__).parents[1] / "helpers" / "grad_worker.py")
FORK_RANKS = str(Path(__file__).parents[1] / "helpers" / "fork_ranks.py")
"""Starts the ranks as torchrun would, forked after the imports they share (its docstring)."""


def ranks_cmd(ranks: int, *target: str) -> list[str]:
    """The command that runs `target` (a script and its arguments, or "-m", a module and its
    arguments) as `ranks` ranks of one job (`fork_ranks.py`)."""
    return [sys.executable, FORK_RANKS, str(ranks), *target]


def run_workers(model: Path, ranks: int, *runs: tuple) -> list[dict]:
    """The outputs of the grad worker's `runs`, each (out file, split, *options), run one after the
    other in one launch of `ranks` processes (`fork_ranks.py` above one rank): a launch's interpreter
    starts and process group cost more than a run on the tiny model."""
    args = [str(model)]
    for i, (out, split, *extra) in enumerate(runs):
        args += (["+"] if i else []) + [str(out), str(split), *extra]
    cmd = [sys.executable, WORKER, *args] if ranks == 1 else ranks_cmd(ranks, WORKER, *args)
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [torch.load(out) for out, *_ in runs]


def run_worker(model: Path, out: Path, ranks: int, split: int, *extra: str) -> dict:
    """The grad worker's output for one run (`run_workers`)."""
    return run_workers(model, ranks, (out, split, *extra))[0]


SPLITS = [6, 11]  # even-ish, and 11 samples vs 1


@pytest.fixture(scope="module")
def single_rank(tiny_model, tmp_path_factory):
    return run_worker(tiny_model, tmp_path_factory.mktemp("g") / "one.pt", ranks=1, split=0)


@pytest.fixture(scope="module")
def two_ranks_by_split(tiny_model, tmp_path_factory) -> dict[int, dict]:
    """Two ranks' output for each split, from one launch."""
    folder = tmp_path_factory.mktemp("g2")
    runs = [(folder / f"two-{split}.pt", split) for split in SPLITS]
    return dict(zip(SPLITS, run_workers(tiny_model, 2, *runs), strict=True))


# Its cases share the module's fixtures: on one xdist worker, which computes them once.
@pytest.mark.xdist_group("trainer_grad")
@pytest.mark.parametrize("split", SPLITS)
def test_two_ranks_give_the_same_gradients_as_one(single_rank, two_ranks_by_split, split):
    two = two_ranks_by_split[split]
    assert two["global_tokens"] == single_rank["global_tokens"]
    for name, g1 in single_rank["grads"].items():
        g2 = two["grads"][name]
        assert g1.abs().max() > 0, name
        torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-6, msg=f"gradient of {name} differs")
    # Per-env token metrics reduced over the ranks equal those of one rank (the ranks hold different
    # envs' samples, in different orders).
    one, both = single_rank["metrics"], two["metrics"]
    assert set(both) == set(one) and "mismatch_kl/a/mean" in one and "entropy/b/max" in one
    for key, value in one.items():
        assert abs(both[key] - value) <= 1e-6 * max(1.0, abs(value)), key


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_step_with_every_rollout_filtered_trains_nothing_under_env_normalization(
    tiny_model, tmp_path, ranks
):
    """Each rank gets only filler micro-batches (no real sample on any rank) and the advantages are
    whitened per env: there is no env to whiten, and the step leaves the parameters alone."""
    out = run_worker(tiny_model, tmp_path / "filtered.pt", ranks, 0, "filtered", "norm=env")
    assert out["metrics"]["loss_tokens"] == 0 and not out["changed"], out["metrics"]


def test_the_critic_and_token_estimators_give_the_same_gradients_on_two_ranks(
    tiny_model, tmp_path, one_rank_gae
):
    """GAE with a critic, KL in the reward and batch whitening: values, the KL sum and the whitening
    moments are all reduced over the ranks, so 2 ranks match 1 for the policy and the critic."""
    one = one_rank_gae
    two = run_worker(tiny_model, tmp_path / "two.pt", 2, 11, "gae")
    critic = [n for n in one["grads"] if n.startswith("critic.")]
    assert critic and any(one["grads"][n].abs().max() > 0 for n in critic if "body.layers" in n)
    for name, g1 in one["grads"].items():
        torch.testing.assert_close(
            two["grads"][name], g1, rtol=1e-4, atol=1e-6, msg=f"gradient of {name} differs"
        )
    for key in (
        "critic/value_loss/all/mean",
        "critic/explained_variance",
        "kl_reward/kl_per_sample",
        "token_advantage/all/std",
    ):
        assert math.isclose(two["metrics"][key], one["metrics"][key], rel_tol=1e-5, abs_tol=1e-7), key
    assert math.isclose(one["metrics"]["token_advantage/all/std"], 1.0, rel_tol=1e-3)  # whitened
