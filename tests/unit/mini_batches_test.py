"""Several optimizer steps per batch (`[trainer] mini_batches`): each mini-batch is an update of its
own on its micro-batches, normalized by its own counts, and its loss's ratio divides by pi_old, the
policy at the step's start (from a first pass without gradients)."""

import sys
from pathlib import Path

import pytest
import torch

from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.rl.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from trainer_test import micro_batches


def trainer(tiny_model, tmp_path, mini_batches: int, lr: float = 1e-2, loss_fn=None, **loss) -> Trainer:
    config = TrainerConfig(model={"name": str(tiny_model)}, seq_len=128, output_dir=tmp_path,
                           mini_batches=mini_batches, optim={"lr": lr}, loss=loss)  # fmt: skip
    return Trainer(config, World(), loss_fn)


def nan_gradient(inputs):
    """A loss that is 0, finite, on every token, and whose gradient is NaN: d sqrt(|x|)/dx at 0 is
    inf * sign(0) = inf * 0."""
    from prime_rl.trainer.losses import LossOutputs

    return LossOutputs((inputs.trainer_logprobs - inputs.trainer_logprobs.detach()).abs().sqrt())


def params(t: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in t.model.named_parameters()}


@pytest.fixture
def batch():
    mbs = micro_batches(0, "m", seq_len=64)
    assert len(mbs) >= 2
    return mbs


def test_two_mini_batches_are_two_updates_each_on_its_half(tiny_model, tmp_path, batch):
    """With the ratio to the sampler (it does not read pi_old), a step of two mini-batches is, to the
    bit, two steps of one on each half: the same updates, each normalized by its own tokens."""
    half = len(batch) // 2
    split = trainer(tiny_model, tmp_path / "a", 2, old_policy="sampler")
    metrics, _ = split.train_step(batch)
    one = trainer(tiny_model, tmp_path / "b", 1, old_policy="sampler")
    one.train_step(batch[:half])
    one.train_step(batch[half:])
    a, b = params(split), params(one)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert metrics["optimizer_steps"] == 2
    whole = trainer(tiny_model, tmp_path / "c", 1, old_policy="sampler")
    whole.train_step(batch)
    assert not all(torch.equal(a[k], v) for k, v in params(whole).items())  # one update differs


def test_later_mini_batches_clip_against_the_policy_at_the_steps_start(tiny_model, tmp_path, batch):
    """Decoupled PPO: with one mini-batch the ratio pi / pi_old is 1 on every token, so PPO never
    clips; with four, the updates before a mini-batch move pi away from pi_old and the clip acts."""
    clipped = {}
    for k in (1, 4):
        metrics, _ = trainer(tiny_model, tmp_path / str(k), k, lr=0.05, old_policy="trainer").train_step(
            batch
        )
        clipped[k] = metrics["clipped_high/all/mean"] + metrics["clipped_low/all/mean"]
        assert metrics["loss_tokens"] > 0
    assert clipped[1] == 0.0
    assert clipped[4] > 0.0


def test_one_mini_batch_runs_no_extra_forward(tiny_model, tmp_path, batch, monkeypatch):
    """pi_old is the loss's own logprobs, detached, with one mini-batch: the first pass does not
    compute it."""
    t = trainer(tiny_model, tmp_path, 1)
    calls = []
    real = t._logprobs
    monkeypatch.setattr(t, "_logprobs", lambda model, b: calls.append(1) or real(model, b))
    t.train_step(batch)
    assert len(calls) == len(batch)  # one forward per micro-batch: the loss's
    calls.clear()
    t.config = t.config.model_copy(update={"mini_batches": 2})
    t.train_step(batch)
    assert len(calls) == 2 * len(batch)


def test_a_mini_batch_with_a_non_finite_loss_skips_its_own_update_and_the_step_counts_as_non_finite(
    tiny_model, tmp_path, batch
):
    """Each mini-batch's own loss decides its update: the healthy first half still updates, as one
    step on it alone does; the broken second half leaves the parameters as they are, and the step's
    loss is NaN, so that the trainer counts it toward `max_nan_steps` and the schedule does not move."""
    import math

    import msgspec

    half = len(batch) // 2
    # NaN sampling logprobs (as a sampler's overflow gives): the ratio to the sampler is NaN.
    broken = [msgspec.structs.replace(mb, logprobs=bytes.fromhex("0000c07f") * (len(mb.logprobs) // 4))
              for mb in batch[half:]]  # fmt: skip
    split = trainer(tiny_model, tmp_path / "a", 2, old_policy="sampler")
    metrics, _ = split.train_step(batch[:half] + broken)
    one = trainer(tiny_model, tmp_path / "b", 1, old_policy="sampler")
    one.train_step(batch[:half])
    a, b = params(split), params(one)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert metrics["optimizer_steps"] == 1
    assert math.isnan(metrics["loss"]) and math.isnan(metrics["grad_norm"])
    assert split.scheduler.last_epoch == 0  # (one.scheduler moved: its one step was finite)
    assert one.scheduler.last_epoch == 1


def test_a_step_of_fewer_micro_batches_than_mini_batches_still_counts_its_updates(
    tiny_model, tmp_path, batch
):
    """`optimizer_steps` is logged on every step of a k > 1 run, also one whose batch packed into a
    single micro-batch (one group, one update), so that its series has no gaps."""
    metrics, _ = trainer(tiny_model, tmp_path, 4, old_policy="sampler").train_step(batch[:1])
    assert metrics["optimizer_steps"] == 1
    one, _ = trainer(tiny_model, tmp_path / "one", 1, old_policy="sampler").train_step(batch[:1])
    assert "optimizer_steps" not in one


def test_updates_skipped_for_a_non_finite_gradient_are_not_counted_and_do_not_move_the_schedule(
    tiny_model, tmp_path, batch
):
    """A finite loss whose gradient is NaN: `update` skips each mini-batch's update, so the step
    reports 0 optimizer steps (it reported 2), the parameters and the learning-rate schedule stay,
    and both skipped updates are counted as non-finite (the trainer's `max_nan_steps` reads it)."""
    import math

    t = trainer(tiny_model, tmp_path, 2, loss_fn=nan_gradient, old_policy="sampler")
    before = params(t)
    metrics, _ = t.train_step(batch)
    assert math.isfinite(metrics["loss"]) and math.isnan(metrics["grad_norm"])
    assert metrics["optimizer_steps"] == 0
    assert metrics["nonfinite_updates"] == 2
    assert all(torch.equal(before[k], v) for k, v in params(t).items())
    assert t.scheduler.last_epoch == 0
