"""The losses' configs: what every loss shares, each built-in's knobs, the rollout correction, and
the registry that names them.

Invariant: this module imports no torch; a built-in's function (`losses/<name>.py`) is imported
only when a trainer builds it (`build_loss`), so configs, `--help` and `rl` stay light.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from prime_rl.config import BaseConfig
from prime_rl.config.plugins import Builtin, Registry

Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class RolloutCorrectionConfig(BaseConfig):
    """How the trainer corrects for the sampler's probabilities differing from its own."""

    type: Literal["none", "tis", "icepop", "seq_mask"] = "none"
    """On the behaviour ratio beta = pi_old / mu (the trainer's policy at the step's start over the
    sampler's): 'none', 'tis' (each token's loss times min(beta, tis_cap)), 'icepop' (drop tokens whose
    beta leaves [low, high]) or 'seq_mask' (drop samples whose geometric-mean beta leaves it)."""

    tis_cap: float = Field(default=2.0, gt=0)
    """'tis': the largest weight a token's loss gets."""

    low: float = Field(default=0.5, ge=0)
    """'icepop' and 'seq_mask': the lowest trusted ratio."""

    high: float = Field(default=2.0, gt=0)
    """'icepop' and 'seq_mask': the highest trusted ratio."""


class LossBase(BaseConfig):
    """Settings every RL loss shares (read by the frame around the loss)."""

    moved_keys: ClassVar[dict[str, str]] = {
        "custom_import_path": "name your loss in 'type' = 'package.module:function'",
        "custom_kwargs": "your loss's keyword arguments are 'kwargs'",
    }

    frame_masks: ClassVar[bool] = True
    """Whether the frame's trust masks (`mask_low`, `mask_high`) drop this loss's tokens; a loss whose
    own clip is its trust region (CISPO) keeps every token."""

    old_policy: Literal["sampler", "trainer"] = "sampler"
    """What the loss's ratio divides by. 'sampler' (the default; verl's bypass mode, prime-rl's
    default): mu, the sampler's logprobs, so the loss's own clip also bounds the sampler's mismatch
    and staleness, and a 'tis' correction would weight that mismatch twice (refused). 'trainer': pi_old,
    the trainer's policy at the step's start (decoupled PPO: verl's decoupled mode, AReaL), so the
    mismatch is the rollout correction's alone; with one mini-batch the ratio is then 1 and only the
    correction and the trust masks act (measured: sum-digits' greedy reward after 40 steps 0.27 with
    it, 0.60 with tis, against 0.76 with 'sampler'; docs/algorithms.md)."""

    ratio_type: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or one per sample (geometric mean of its token ratios, GSPO-style)."""

    mask_low: float = Field(default=0.125, ge=0)
    """Tokens whose behaviour ratio pi_old / mu (per sample with `ratio_type = 'sequence'`) is below
    this are dropped from the loss: trainer and sampler disagree too much to trust the sample."""

    mask_high: float = Field(default=8.0, gt=0)
    """Tokens whose behaviour ratio is above this are dropped from the loss."""

    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of a KL penalty to the frozen starting model (0 disables it and the reference model)."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Estimator of the KL to the reference model."""

    top_entropy_fraction: float = Field(default=1.0, gt=0, le=1)
    """Train only on this fraction of loss tokens with the highest entropy (per micro-batch)."""

    entropy_coef: float = Field(default=0.0, ge=0)
    """Entropy bonus: subtract this times each kept token's entropy (of the trainer's next-token
    distribution) from its loss, pushing toward more varied sampling. 0: off (the entropy is then
    not differentiated at all)."""

    aggregation: Aggregation = "token-mean"
    """How per-token losses become the step's loss (`losses/aggregation.py`): 'token-mean' (every
    loss token of the global batch weighs the same), 'seq-mean-token-sum', 'seq-mean-token-mean'
    (every sample weighs the same) or 'seq-mean-token-sum-norm' (Dr. GRPO: token sums over a
    constant, `aggregation_norm`)."""

    aggregation_norm: int | None = Field(default=None, ge=1)
    """The constant of 'seq-mean-token-sum-norm' (unset: the trainer's seq_len)."""


class CustomLoss(LossBase):
    """Your own loss: `fn(LossInputs, **kwargs) -> LossOutputs`, run inside the frame (it gets the
    trust-masked tokens and the importance log-ratio; the KL penalty is added after it)."""

    type: str
    """Where the function lives, as 'package.module:function'."""

    kwargs: dict[str, Any] = {}
    """Keyword arguments passed to the function on every call."""


class PPOLoss(LossBase):
    """The clipped importance ratio times the advantage."""

    type: Literal["ppo"] = "ppo"
    """Selects this loss."""

    clip_low: float = Field(default=0.2, ge=0)
    """The ratio is clipped below at 1 - clip_low."""

    clip_high: float = Field(default=0.28, ge=0)
    """The ratio is clipped above at 1 + clip_high."""


class CPGDLoss(LossBase):
    """The clipped log-ratio times the advantage, plus a policy-drift penalty."""

    type: Literal["cpgd"] = "cpgd"
    """Selects this loss."""

    clip_low: float = Field(default=0.2, ge=0)
    """The log-ratio is clipped below at log(1 - clip_low)."""

    clip_high: float = Field(default=0.28, ge=0)
    """The log-ratio is clipped above at log(1 + clip_high)."""

    drift_coef: float = Field(default=0.1, ge=0)
    """Weight of the policy-drift penalty."""


class CISPOLoss(LossBase):
    """A clipped, stop-gradient importance weight on the policy gradient, on every token (the frame's
    trust masks do not apply: the clip is its trust region)."""

    frame_masks: ClassVar[bool] = False

    type: Literal["cispo"] = "cispo"
    """Selects this loss."""

    clip_low: float = Field(default=1.0, ge=0)
    """The weight is clipped below at 1 - clip_low (1: no lower bound, as in the paper)."""

    clip_high: float = Field(default=4.0, ge=0)
    """The weight is clipped above at 1 + clip_high (the paper's one tuned knob)."""


class DualClipLoss(LossBase):
    """PPO's clipped surrogate with a lower bound for negative advantages."""

    type: Literal["dual_clip"] = "dual_clip"
    """Selects this loss."""

    clip_low: float = Field(default=0.2, ge=0)
    """The ratio is clipped below at 1 - clip_low."""

    clip_high: float = Field(default=0.28, ge=0)
    """The ratio is clipped above at 1 + clip_high."""

    clip_c: float = Field(default=3.0, gt=1)
    """The bound for negative advantages: the surrogate is at least c A (c > 1)."""


class SAPOLoss(LossBase):
    """A temperature-controlled sigmoid gate on the ratio, per advantage sign."""

    type: Literal["sapo"] = "sapo"
    """Selects this loss."""

    tau_pos: float = Field(default=1.0, gt=0)
    """Gate temperature for tokens with a positive advantage."""

    tau_neg: float = Field(default=1.05, gt=0)
    """Gate temperature for tokens with a zero or negative advantage."""


class DPPOLoss(LossBase):
    """A probability-difference trust region per advantage sign, plus a squared log-ratio penalty."""

    type: Literal["dppo"] = "dppo"
    """Selects this loss."""

    delta_low: float = Field(default=0.2, ge=0)
    """Tokens with A <= 0 whose probability fell by more than this are masked."""

    delta_high: float = Field(default=0.2, ge=0)
    """Tokens with A > 0 whose probability rose by more than this are masked."""

    kl_tau: float = Field(default=1e-3, ge=0)
    """Weight of the (log r)^2 penalty (the name prime-rl gives it)."""


LOSSES = Registry("loss", LossBase, CustomLoss, [
    Builtin("ppo", "prime_rl.trainer.losses.ppo:ppo", PPOLoss),
    Builtin("cpgd", "prime_rl.trainer.losses.cpgd:cpgd", CPGDLoss),
    Builtin("cispo", "prime_rl.trainer.losses.cispo:cispo", CISPOLoss),
    Builtin("dual_clip", "prime_rl.trainer.losses.dual_clip:dual_clip", DualClipLoss),
    Builtin("sapo", "prime_rl.trainer.losses.sapo:sapo", SAPOLoss),
    Builtin("dppo", "prime_rl.trainer.losses.dppo:dppo", DPPOLoss),
])  # fmt: skip

LossConfig = LOSSES.config_type()
