"""The policy losses against hand computations, their ratio to the sampler: PPO's clipped ratio and
CPGD's clipped log-ratio with its policy-drift penalty."""

import math

import pytest
import torch

from prime_rl.trainer.losses import LossInputs, build_loss
from prime_rl.trainer.losses.config import CPGDLoss, PPOLoss

RATIOS = [1.5, 0.5, 1.0]
ADVANTAGES = [1.0, -1.0, 2.0]


def inputs() -> LossInputs:
    sampling = torch.tensor([-1.0, -2.0, -3.0])
    trainer = (sampling + torch.log(torch.tensor(RATIOS))).requires_grad_(True)
    return LossInputs(
        trainer_logprobs=trainer,
        sampling_logprobs=sampling,
        advantages=torch.tensor(ADVANTAGES),
        loss_mask=torch.ones(3, dtype=torch.bool),
        entropy=torch.ones(3),
        sample_lens=[3],
    )


def test_ppo_by_hand():
    x = inputs()
    out = build_loss(
        PPOLoss(clip_low=0.2, clip_high=0.28, mask_low=0.0, mask_high=100.0, old_policy="sampler")
    )(x)
    # min(r A, clip(r) A): 1.28 * 1, 0.8 * -1 (the pessimistic side), 1 * 2
    torch.testing.assert_close(out.token_loss, torch.tensor([-1.28, 0.8, -2.0]))
    out.token_loss.sum().backward()
    # clipped tokens get no gradient; the unclipped one gets -A * r
    torch.testing.assert_close(x.trainer_logprobs.grad, torch.tensor([0.0, 0.0, -2.0]))
    assert out.masks["clipped_high"].tolist() == [True, False, False]
    assert out.masks["clipped_low"].tolist() == [False, True, False]


def test_cpgd_by_hand():
    x = inputs()
    config = CPGDLoss(
        clip_low=0.2, clip_high=0.28, drift_coef=0.1, mask_low=0.0, mask_high=100.0, old_policy="sampler"
    )
    out = build_loss(config)(x)
    drift = [r - 1 - math.log(r) for r in RATIOS]
    want = [
        -math.log(1.28) * 1.0 + 0.1 * drift[0],  # log 1.5 clipped to log 1.28
        -math.log(0.8) * -1.0 + 0.1 * drift[1],  # log 0.5 clipped to log 0.8 (pessimistic for A < 0)
        -0.0 * 2.0 + 0.0,
    ]
    torch.testing.assert_close(out.token_loss, torch.tensor(want))
    out.token_loss.sum().backward()
    # clipped: only the drift's gradient, 0.1 * (r - 1); unclipped at r = 1: -A (log-ratio gradient)
    torch.testing.assert_close(x.trainer_logprobs.grad, torch.tensor([0.05, -0.05, -2.0]))


@pytest.mark.parametrize("loss_type", ["ppo", "cpgd"])
def test_both_losses_agree_on_policy(loss_type):
    """At ratio 1 both are -A per token with gradient -A: they differ only off-policy."""
    x = inputs()
    x = LossInputs(x.sampling_logprobs.clone().requires_grad_(True), *[getattr(x, f) for f in
                   ("sampling_logprobs", "advantages", "loss_mask", "entropy", "sample_lens")])  # fmt: skip
    out = build_loss({"ppo": PPOLoss, "cpgd": CPGDLoss}[loss_type]())(x)
    out.token_loss.sum().backward()
    torch.testing.assert_close(x.trainer_logprobs.grad, -torch.tensor(ADVANTAGES))


@pytest.mark.parametrize("loss_type", ["ppo", "cpgd"])
def test_one_token_sampled_far_below_the_trainer_costs_no_step(loss_type):
    """Sampling logprob -100 against the trainer's -0.1: its ratio exp(99.9) is inf in float32. The
    token is masked (ratio above mask_high), and the loss and gradient stay finite, so the step
    trains on the other token instead of being skipped as non-finite."""
    config = PPOLoss() if loss_type == "ppo" else CPGDLoss()
    trainer = torch.tensor([-0.5, -0.1], requires_grad=True)
    out = build_loss(config)(
        LossInputs(
            trainer,
            torch.tensor([-0.6, -100.0]),
            torch.tensor([1.0, 1.0]),
            torch.ones(2, dtype=torch.bool),
            torch.ones(2),
            [2],
        )
    )
    out.token_loss.sum().backward()
    assert torch.isfinite(out.token_loss).all() and torch.isfinite(trainer.grad).all()
    assert out.masks["masked_high"].tolist() == [False, True]
    assert trainer.grad[0] != 0 and trainer.grad[1] == 0


def test_a_sequence_ratio_with_a_token_correction_names_both_keys():
    from pydantic import ValidationError

    from prime_rl.trainer.config import TrainerConfig

    with pytest.raises(
        ValidationError, match=r"loss.ratio_type = 'sequence' .* rollout_correction.type = 'icepop'"
    ):
        TrainerConfig(loss={"ratio_type": "sequence"}, rollout_correction={"type": "icepop"})
    TrainerConfig(loss={"ratio_type": "sequence"}, rollout_correction={"type": "seq_mask"})


@pytest.mark.parametrize("loss", [{}, {"type": "cispo"}, {"type": "my_package.losses:mine"}])
def test_tis_is_refused_under_the_default_old_policy_of_every_loss(loss):
    """A loss that does not set `old_policy` divides by the sampler (its field's default), a user's
    own included, so a TIS weight on top would count the sampler's mismatch twice."""
    from pydantic import ValidationError

    from prime_rl.trainer.config import TrainerConfig

    with pytest.raises(ValidationError, match=r"loss.old_policy = 'sampler' .* 'tis'"):
        TrainerConfig(loss=loss, rollout_correction={"type": "tis"})
    config = TrainerConfig(loss={**loss, "old_policy": "trainer"}, rollout_correction={"type": "tis"})
    assert config.loss.old_policy == "trainer" and config.rollout_correction.type == "tis"


def test_the_trainer_differentiates_the_entropy_only_for_a_bonus(tiny_model, tmp_path):
    import sys
    from pathlib import Path

    from prime_rl.trainer.config import TrainerConfig
    from prime_rl.trainer.parallel.dist import World
    from prime_rl.trainer.rl.trainer import Trainer

    sys.path.insert(0, str(Path(__file__).parent))
    from trainer_test import micro_batches

    def grad_norm(coef: float) -> float:
        config = TrainerConfig(model={"name": str(tiny_model)}, seq_len=128, output_dir=tmp_path / str(coef),
                               loss={"entropy_coef": coef})  # fmt: skip
        return Trainer(config, World()).train_step(micro_batches(0, "e"))[0]["grad_norm"]

    assert abs(grad_norm(1.0) - grad_norm(0.0)) > 1e-3
