"""The RL objective of the trainer's step (`trainer/step.py`): the policy, its reference, the
estimator and credit, the loss, and the critic.

First pass (`prepare`, no gradients): the reference model's logprobs and the critic's old values
where needed, then each micro-batch's per-token advantages, composed once (`rl/credit.py`). Then per
micro-batch (`loss`): the policy's logprobs at the sampling temperature, the configured loss in its
frame, weighted by the aggregation mode over the step's global counts, plus the MoE load-balancing
term and the critic's value loss.

With context parallelism (`context_parallel.py`) each rank computes the logprobs of its share of a
micro-batch's positions, and they are gathered back to full length: the estimators and losses run
on the whole micro-batch on every rank of the group, and each token is owned (counted in the loss
and in the metrics) by one rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from prime_rl.trainer.batch import PackedBatch
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.data import check_sample_lengths, check_token_ids
from prime_rl.trainer.estimators import TokenAdvantageError, TokenAdvantageInputs, build_estimator
from prime_rl.trainer.logprobs import align_to_tokens, batch_logprobs
from prime_rl.trainer.lora import adapters_off
from prime_rl.trainer.losses import LossFn, LossInputs, LossOutputs, build_loss
from prime_rl.trainer.losses.aggregation import divisor, token_weights
from prime_rl.trainer.model import build_model
from prime_rl.trainer.optim import build_optimizer, build_scheduler
from prime_rl.trainer.parallel.dist import World, all_reduce_sum
from prime_rl.trainer.rl.credit import Credit, compose
from prime_rl.trainer.rl.critic import explained_variance, load_critic, value_loss
from prime_rl.trainer.rl.kl_reward import KLController, kl_rewards
from prime_rl.trainer.stats import TokenStats
from prime_rl.trainer.step import Accumulated, Context, Part, accumulate, train_step
from prime_rl.transport.messages import MicroBatch


@dataclass
class MicroBatchResult:
    """What the loss saw, per token, for metrics and the token export."""

    batch: PackedBatch
    trainer_logprobs: torch.Tensor
    token_loss: torch.Tensor
    """Of the whole micro-batch (the same on every rank of a cp group)."""
    masks: dict[str, torch.Tensor]
    advantages: torch.Tensor
    """The per-token advantages the loss saw (`rl/credit.py`)."""


@dataclass(frozen=True)
class Prepared:
    """One micro-batch ready for the loss: the batch and what the first pass computed, per token."""

    batch: PackedBatch
    advantages: torch.Tensor
    """What the loss sees (`rl/credit.py`)."""
    ref_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    """pi_old, with several mini-batches (`mini_batches`); None: the loss's own logprobs, detached."""
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


class Trainer:
    def __init__(self, config: TrainerConfig, world: World, loss_fn: LossFn | None = None):
        self.config = config
        self.world = world
        self.model = build_model(config.model, world, lora=config.lora, seed=config.seed)
        self.ref_model = None
        if self.needs_reference and config.lora is None:
            # With LoRA the reference is the same model with its adapters off (`_reference_logprobs`).
            self.ref_model = build_model(config.model, world, role="the reference model", trained=False)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.scheduler, config.max_steps)
        self.loss_fn: LossFn = loss_fn or build_loss(config.loss, correction=config.rollout_correction)
        self.estimator = build_estimator(config.advantage)
        self.kl = KLController(config.kl_reward.beta, config.kl_reward.target, config.kl_reward.horizon)
        self.critic = self.critic_optimizer = None
        if config.advantage.uses_critic:
            self.critic = load_critic(config.critic, config.model, world, config.lora, config.seed)
            self.critic_optimizer = build_optimizer(self.critic, config.critic.optim)

    def _logprobs(self, model: torch.nn.Module, b: PackedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        # (the entropy is differentiated only for an entropy bonus)
        return batch_logprobs(
            model, b, self.config.model.logprob_chunk_tokens, self.config.loss.entropy_coef > 0
        )

    @property
    def needs_reference(self) -> bool:
        return self.config.loss.kl_coef > 0 or self.config.kl_reward.beta > 0

    def _reference_logprobs(self, b: PackedBatch) -> torch.Tensor:
        """The frozen starting model's logprobs: the reference copy, or with LoRA the model itself
        with its adapters off (the base weights never change)."""
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, b)[0]
        with adapters_off(self.model):
            return self._logprobs(self.model, b)[0]

    def _values(self, b: PackedBatch) -> torch.Tensor:
        """The critic's values of the whole micro-batch, aligned to tokens."""
        v = self.critic(b.shard.take(b.input_ids), b.shard.take(b.position_ids), **b.shard.model_kwargs())
        return align_to_tokens(b.shard.gather(v))

    def extra_state(self) -> dict:
        """What a checkpoint keeps besides the modules and optimizers (the same on every rank)."""
        return {"kl_beta": self.kl.beta}

    def load_extra_state(self, state: dict) -> None:
        if "kl_beta" in state:
            self.kl = replace(self.kl, beta=state["kl_beta"])

    def policy_trains(self, step: int) -> bool:
        """False during the critic's warm-up steps."""
        return self.critic is None or step >= self.config.critic.warmup_steps

    @torch.no_grad()
    def prepare(self, batches: list[PackedBatch]) -> tuple[list[Prepared], dict[str, float]]:
        """First pass, without gradients: reference logprobs and old values where needed, then each
        micro-batch's per-token advantages, composed from the estimator's and the orchestrator's
        terms in one place (`rl/credit.py`)."""
        firsts, credits, kl_sum, samples = [], [], self.world.scalars(0.0)[0], 0
        lead = self.world.cp_rank == 0
        kl_in_reward = self.config.kl_reward.beta > 0
        several = self.config.mini_batches > 1
        for b in batches:
            ref = self._reference_logprobs(b) if self.needs_reference else None
            # pi_old before any of the step's updates: the later mini-batches' ratio divides by it.
            old = self._logprobs(self.model, b)[0] if several else None
            values = self._values(b) * b.loss_mask if self.critic is not None else None
            kl_reward = torch.zeros_like(b.sampling_logprobs)
            if kl_in_reward:
                kl_reward, kl = kl_rewards(
                    b.sampling_logprobs, ref, b.loss_mask, self.kl.beta, self.config.kl_reward.estimator
                )
                kl_sum += (kl * b.owned).sum().double()
                samples += b.samples_with_loss if lead else 0
            est = self.estimator(
                TokenAdvantageInputs(
                    loss_mask=b.loss_mask,
                    sample_lens=b.sample_lens,
                    rollout_advantages=b.per_token(b.rollout_advantages),
                    rollout_rewards=b.rewards,
                    kl_rewards=kl_reward,
                    kl_in_reward=kl_in_reward,
                    values=values,
                ),
                host=self.world.host,
            )
            if self.critic is not None and est.returns is None:
                raise TokenAdvantageError(f"estimator '{self.estimator.name}' gave no returns for the critic")
            credits.append(Credit(b, est.advantages))
            firsts.append((ref, old, values, est.returns))
        advantages = compose(credits, self.config.advantage.batch_normalize, self.world)
        out = [
            Prepared(b, a, ref, old, values, returns)
            for b, a, (ref, old, values, returns) in zip(batches, advantages, firsts, strict=True)
        ]
        metrics: dict[str, float] = {}
        if kl_in_reward:
            both = self.world.host(
                all_reduce_sum(torch.stack([kl_sum, self.world.scalars(samples)[0]]), self.world)
            )
            metrics["kl_reward/kl_per_sample"] = both[0] / max(both[1], 1.0)
            metrics["kl_reward/beta"] = self.kl.beta
            metrics["kl_reward/samples"] = both[1]
        if self.critic is not None:
            metrics["critic/explained_variance"] = explained_variance(out, self.world)
        return out, metrics

    @property
    def parts(self) -> list[Part]:
        """What the step trains: the policy, then the critic when there is one."""
        parts = [Part("", self.model, self.optimizer, self.config.optim.max_norm)]
        if self.critic is not None:
            parts.append(
                Part("critic/", self.critic, self.critic_optimizer, self.config.critic.optim.max_norm)
            )
        return parts

    def trains(self, step: int) -> list[bool]:
        return [self.policy_trains(step)] + ([True] if self.critic is not None else [])

    def batches(self, micro_batches: list[MicroBatch]) -> list[PackedBatch]:
        context = getattr(self.model.config, "max_position_embeddings", None)
        vocab = getattr(self.model.config, "vocab_size", None)
        for mb in micro_batches:
            mb.validate(seq_len=self.config.seq_len)
            check_sample_lengths(mb, context, self.config.model.name)
            check_token_ids(mb, vocab, context, self.config.model.name)
        return [PackedBatch.of(mb, self.world) for mb in micro_batches]

    def loss(self, p: Prepared, ctx: Context) -> tuple[torch.Tensor, MicroBatchResult]:
        """One micro-batch's policy loss (and the critic's), over the step's global counts."""
        b, n, train_policy = p.batch, ctx.totals, ctx.trains[0]
        loss_config = self.config.loss
        with torch.set_grad_enabled(train_policy):
            with ctx.routing(b) as routing:
                lp, entropy = self._logprobs(self.model, b)
            out = self.loss_fn(
                LossInputs(
                    trainer_logprobs=lp,
                    sampling_logprobs=b.sampling_logprobs,
                    advantages=p.advantages,
                    loss_mask=b.loss_mask,
                    entropy=entropy,
                    sample_lens=b.sample_lens,
                    ref_logprobs=p.ref_logprobs,
                    old_logprobs=p.old_logprobs,
                    sample_of_token=b.sample_of_token,
                )
            )
            token_loss = out.token_loss * b.owned
            norm = loss_config.aggregation_norm or self.config.seq_len
            weights = token_weights(loss_config.aggregation, b.loss_tokens, b.sample_of_token, norm)
            if weights is not None:
                token_loss = token_loss * weights
            loss = token_loss.sum() / divisor(loss_config.aggregation, n.loss_tokens, n.samples)
            aux = ctx.aux_loss(routing, b)
            loss = loss if aux is None else loss + aux
        self._record(ctx.stats, p, lp.detach(), entropy, out)
        if self.critic is not None:
            loss = loss + self._critic_loss(ctx.stats, p, max(n.loss_tokens, 1.0))
        return loss, MicroBatchResult(b, lp.detach(), out.token_loss.detach(), out.masks, p.advantages)

    def metrics(self, records: list[MicroBatchResult], ctx: Context) -> dict[str, float]:
        """The step's loss: the per-token mean of the loss over the global batch (whatever the
        aggregation); every rank of a cp group holds its micro-batches' full token losses, so its
        first rank counts them."""
        local = self.world.scalars(0.0)
        for r in records if self.world.cp_rank == 0 else ():
            local[0] += r.token_loss.sum().double()
        (loss_sum,) = self.world.host(all_reduce_sum(local, self.world))
        metrics = {"loss": loss_sum / max(ctx.totals.loss_tokens, 1.0)}
        if self.critic is not None:
            metrics["critic/lr"] = self.config.critic.optim.lr
            metrics["critic/policy_trained"] = float(ctx.trains[0])
        return metrics

    def _moe(self) -> tuple[bool, float]:
        return self.config.moe.replay, self.config.moe.aux_loss_coef

    def accumulate(self, micro_batches: list[MicroBatch], step: int = 0) -> Accumulated:
        """Forward and backward over this rank's micro-batches (policy, and critic when there is one)."""
        return accumulate(
            self, self.batches(micro_batches), self.parts, self.world, self.trains(step), self._moe()
        )

    def train_step(
        self, micro_batches: list[MicroBatch], step: int = 0
    ) -> tuple[dict[str, float], list[MicroBatchResult]]:
        batches = self.batches(micro_batches)
        metrics, results = train_step(
            self,
            batches,
            self.parts,
            self.scheduler,
            self.world,
            trains=self.trains(step),
            moe=self._moe(),
            mini_batches=self.config.mini_batches,
        )
        if "kl_reward/samples" in metrics:
            self.kl = self.kl.update(metrics["kl_reward/kl_per_sample"], int(metrics["kl_reward/samples"]))
        return metrics, results

    def _critic_loss(self, stats: TokenStats, p: Prepared, denom: float) -> torch.Tensor:
        b = p.batch
        values = self._values(b)
        loss, clipped = value_loss(
            values, p.old_values, p.returns, b.loss_mask, self.config.critic.value_clip
        )
        rows = b.per_token(stats.rows(b.env_names))
        stats.add("critic/value_loss", rows, loss, b.counted)
        stats.add("critic/value_clipped", rows, clipped.float(), b.counted)
        stats.add("critic/value", rows, values.detach(), b.counted)
        return (loss * b.owned).sum() / denom

    def _record(self, stats: TokenStats, p: Prepared, lp: torch.Tensor, entropy, out: LossOutputs) -> None:
        b, mask = p.batch, p.batch.counted
        rows = b.per_token(stats.rows(b.env_names))  # env row per token
        d = torch.where(mask, lp - b.sampling_logprobs, 0.0)
        stats.add("loss", rows, out.token_loss, mask)
        stats.add("entropy", rows, entropy, mask)
        stats.add("mismatch_kl", rows, torch.exp(d) - 1 - d, mask)  # KL(sampler || trainer), k3 estimate
        stats.add("token_advantage", rows, p.advantages, mask)
        for name, flag in out.masks.items():
            stats.add(name, rows, flag.float(), mask)
        for name, value in out.values.items():
            stats.add(name, rows, value, mask)
