"""One optimizer step on the micro-batches of this rank, with the loss normalized globally.

Normalization (the contract of DESIGN.md):
1. before the micro-batch loop, all-reduce (sum) the loss tokens this rank owns over all dp x cp ranks;
2. each micro-batch's loss is the sum of its owned tokens' losses divided by that global count;
3. after the loop, multiply the gradients by the factor FSDP divided them by (dp x cp, the ranks it
   shards over).
The gradient is then that of the per-token mean over the whole global batch, however the tokens
are split across ranks, micro-batches and context-parallel shards.

With context parallelism (`context_parallel.py`) each rank computes the logprobs of its share of a
micro-batch's positions, and they are gathered back to full length: the estimators and losses run
on the whole micro-batch on every rank of the group, and each token is owned (counted in the loss
and in the metrics) by one rank. Reductions of per-micro-batch data that every rank of a group
holds (sample counts, total tokens) count the group's cp rank 0 only.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.data import check_sample_lengths
from prime_rl.trainer.estimators import TokenAdvantageError, TokenAdvantageInputs, build_estimator
from prime_rl.trainer.logprobs import align_to_tokens, next_token_targets, position_logprobs
from prime_rl.trainer.lora import adapters_off
from prime_rl.trainer.losses import LossFn, LossInputs, LossOutputs, build_loss
from prime_rl.trainer.losses.aggregation import divisor, token_weights
from prime_rl.trainer.memory import peak_memory_gb
from prime_rl.trainer.model import fsdp_group_size, load_model
from prime_rl.trainer.moe.step import MoEStep, sample_positions
from prime_rl.trainer.optim import build_optimizer, build_scheduler, clip_grad_norm
from prime_rl.trainer.parallel.context_parallel import SequenceShard, shard_micro_batch
from prime_rl.trainer.parallel.dist import World, all_reduce_sum
from prime_rl.trainer.rl.credit import Credit, compose, rollout_advantages
from prime_rl.trainer.rl.critic import explained_variance, load_critic, value_loss
from prime_rl.trainer.rl.kl_reward import KLController, kl_rewards
from prime_rl.trainer.rl.returns import sample_index
from prime_rl.trainer.rl.stats import TokenStats
from prime_rl.transport.messages import MicroBatch


@dataclass
class MicroBatchResult:
    """What the loss saw, per token, for metrics and the token export."""

    mb: MicroBatch
    trainer_logprobs: torch.Tensor
    token_loss: torch.Tensor
    """Of the whole micro-batch (the same on every rank of a cp group)."""
    masks: dict[str, torch.Tensor]
    advantages: torch.Tensor
    """The per-token advantages the loss saw (`rl/credit.py`)."""


@dataclass
class Accumulated:
    """A step's gradients are in the modules; this is what else the pass produced."""

    stats: TokenStats
    results: list[MicroBatchResult]
    global_tokens: float
    """Loss tokens of the step on all ranks (the loss's denominator)."""
    metrics: dict[str, float]
    """Step-level metrics of the first pass (KL in the reward, the critic's explained variance)."""


@dataclass
class Prepared:
    """One micro-batch ready for the losses: its tensors, with `advantages` now per token."""

    mb: MicroBatch
    t: dict[str, torch.Tensor]
    """Full-length per-token tensors; t["owned"] marks the tokens this rank counts."""
    shard: SequenceShard
    ref_logprobs: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None


class Trainer:
    def __init__(self, config: TrainerConfig, world: World, loss_fn: LossFn | None = None):
        self.config = config
        self.world = world
        self.model = load_model(config.model, world, config.lora, config.seed)
        self.ref_model = None
        if self.needs_reference and config.lora is None:
            # With LoRA the reference is the same model with its adapters off (`_reference_logprobs`).
            self.ref_model = load_model(config.model, world)
            self.ref_model.requires_grad_(False)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.scheduler, config.max_steps)
        self.loss_fn: LossFn = loss_fn or build_loss(config.loss, correction=config.rollout_correction)
        self.estimator = build_estimator(config.advantage)
        self.kl = KLController(config.kl_reward.beta, config.kl_reward.target, config.kl_reward.horizon)
        self.critic = self.critic_optimizer = None
        if config.advantage.uses_critic:
            self.critic = load_critic(config.critic, config.model, world, config.lora, config.seed)
            self.critic_optimizer = build_optimizer(self.critic, config.critic.optim)

    def _tensors(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        dev = self.world.device
        a = mb.arrays()
        t = {
            "input_ids": torch.from_numpy(a["input_ids"].astype("int64")).to(dev),
            "position_ids": torch.from_numpy(a["position_ids"].astype("int64")).to(dev),
            "loss_mask": torch.from_numpy(a["loss_mask"].astype(bool)).to(dev),
            "logprobs": torch.from_numpy(a["logprobs"].copy()).to(dev),
            "rollout_advantages": rollout_advantages(mb.advantages, mb.sample_lens, dev),
        }
        if "token_advantages" in a:
            t["token_advantages"] = torch.from_numpy(a["token_advantages"].copy()).to(dev)
        if "routes" in a:
            t["routes"] = torch.from_numpy(a["routes"].astype("int64")).to(dev)
        return t

    def _shard(self, mb: MicroBatch) -> SequenceShard:
        w = self.world
        return shard_micro_batch(mb.sample_lens, w.cp, w.cp_rank, w.cp_group, w.device)

    def _logprobs(
        self, model: torch.nn.Module, t: dict, shard: SequenceShard, temperature: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs, entropy) of the whole micro-batch, aligned to tokens; this rank computes its shard."""
        lp, entropy = position_logprobs(
            model,
            shard.take(t["input_ids"]),
            shard.take(t["position_ids"]),
            shard.take(next_token_targets(t["input_ids"])),
            temperature,
            self.config.model.logprob_chunk_tokens,
            **shard.model_kwargs(),
        )
        if self.config.loss.entropy_coef == 0:  # differentiated only for an entropy bonus
            entropy = entropy.detach()
        return align_to_tokens(shard.gather(lp)), align_to_tokens(shard.gather(entropy))

    @property
    def needs_reference(self) -> bool:
        return self.config.loss.kl_coef > 0 or self.config.kl_reward.beta > 0

    def _reference_logprobs(self, t: dict, shard: SequenceShard, temperature: float) -> torch.Tensor:
        """The frozen starting model's logprobs: the reference copy, or with LoRA the model itself
        with its adapters off (the base weights never change)."""
        if self.ref_model is not None:
            return self._logprobs(self.ref_model, t, shard, temperature)[0]
        with adapters_off(self.model):
            return self._logprobs(self.model, t, shard, temperature)[0]

    def _values(self, t: dict, shard: SequenceShard) -> torch.Tensor:
        """The critic's values of the whole micro-batch, aligned to tokens."""
        v = self.critic(shard.take(t["input_ids"]), shard.take(t["position_ids"]), **shard.model_kwargs())
        return align_to_tokens(shard.gather(v))

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
    def prepare(self, micro_batches: list[MicroBatch]) -> tuple[list[Prepared], dict[str, float]]:
        """First pass, without gradients: reference logprobs and old values where needed, then each
        micro-batch's per-token advantages, composed from the estimator's and the orchestrator's
        terms in one place (`rl/credit.py`)."""
        out, credits, kl_sum, samples = [], [], self.world.scalars(0.0)[0], 0
        lead = self.world.cp_rank == 0
        for mb in micro_batches:
            t = self._tensors(mb)
            shard = self._shard(mb)
            t["owned"] = shard.owned_tokens(self.world.device)
            mask = t["loss_mask"]
            ref = values = None
            if self.needs_reference:
                ref = self._reference_logprobs(t, shard, mb.temperature)
            if self.critic is not None:
                values = self._values(t, shard) * mask
            kl_reward = torch.zeros_like(t["logprobs"])
            if self.config.kl_reward.beta > 0:
                kl_reward, kl = kl_rewards(
                    t["logprobs"], ref, mask, self.kl.beta, self.config.kl_reward.estimator
                )
                kl_sum += (kl * t["owned"]).sum().double()
                if lead:
                    samples += sum(1 for n in mb.loss_tokens_per_sample() if n > 0)
            est = self.estimator(
                TokenAdvantageInputs(
                    loss_mask=mask,
                    sample_lens=mb.sample_lens,
                    rollout_advantages=t["rollout_advantages"],
                    rollout_rewards=torch.tensor(mb.rewards, device=mask.device),
                    kl_rewards=kl_reward,
                    kl_in_reward=self.config.kl_reward.beta > 0,
                    values=values,
                ),
                host=self.world.host,
            )
            if self.critic is not None and est.returns is None:
                raise TokenAdvantageError(f"estimator '{self.estimator.name}' gave no returns for the critic")
            credits.append(Credit(est.advantages, mask, t["owned"], mb.sample_lens, mb.env_names,
                                  t.get("token_advantages")))  # fmt: skip
            out.append(Prepared(mb, t, shard, ref, values, est.returns))
        for p, advantages in zip(
            out, compose(credits, self.config.advantage.batch_normalize, self.world), strict=True
        ):
            p.t["advantages"] = advantages
        metrics: dict[str, float] = {}
        if self.config.kl_reward.beta > 0:
            both = self.world.host(
                all_reduce_sum(torch.stack([kl_sum, self.world.scalars(samples)[0]]), self.world)
            )
            metrics["kl_reward/kl_per_sample"] = both[0] / max(both[1], 1.0)
            metrics["kl_reward/beta"] = self.kl.beta
            metrics["kl_reward/samples"] = both[1]
        if self.critic is not None:
            metrics["critic/explained_variance"] = explained_variance(out, self.world)
        return out, metrics

    def accumulate(self, micro_batches: list[MicroBatch], step: int = 0) -> Accumulated:
        """Forward and backward over this rank's micro-batches (policy, and critic when there is one)."""
        context = getattr(self.model.config, "max_position_embeddings", None)
        for mb in micro_batches:
            mb.validate(seq_len=self.config.seq_len)
            check_sample_lengths(mb, context, self.config.model.name)
        prepared, prepare_metrics = self.prepare(micro_batches)
        local = self.world.scalars(0.0, 0.0)
        lead = self.world.cp_rank == 0  # a cp group's samples are counted once
        for p in prepared:
            local[0] = local[0] + (p.t["loss_mask"] & p.t["owned"]).sum()
            if lead:
                local[1] += sum(1 for n in p.mb.loss_tokens_per_sample() if n > 0)
        global_tokens, global_samples = self.world.host(all_reduce_sum(local, self.world))
        denom = max(global_tokens, 1.0)
        aggregation = self.config.loss.aggregation
        loss_denom = divisor(aggregation, global_tokens, global_samples)
        train_policy = self.policy_trains(step)
        stats, results = TokenStats(self.world.device), []
        moe = MoEStep.start(self.model, self.config.moe.replay, self.config.moe.aux_loss_coef, self.world)
        for p in prepared:
            mb, t = p.mb, p.t
            with torch.set_grad_enabled(train_policy):
                routing_context = nullcontext()
                if moe is not None:
                    routes = p.shard.take(t["routes"]) if "routes" in t else None
                    routing_context = moe.forward(
                        p.shard.take(sample_positions(mb, t["input_ids"].device)), routes
                    )
                with routing_context as routing:
                    lp, entropy = self._logprobs(self.model, t, p.shard, mb.temperature)
                inputs = LossInputs(
                    lp,
                    t["logprobs"],
                    t["advantages"],
                    t["loss_mask"],
                    entropy,
                    mb.sample_lens,
                    p.ref_logprobs,
                )
                out = self.loss_fn(inputs)
                token_loss = out.token_loss * t["owned"]
                weights = token_weights(aggregation, t["loss_mask"], mb.loss_tokens_per_sample(), mb.sample_lens,
                                        self.config.loss.aggregation_norm or self.config.seq_len)  # fmt: skip
                if weights is not None:
                    token_loss = token_loss * weights
                loss = token_loss.sum() / loss_denom
                if moe is not None:  # its load-balancing loss, weighted by the loss tokens
                    aux = moe.aux_loss(routing, (t["loss_mask"] & t["owned"]).sum() / denom)
                    loss = loss if aux is None else loss + aux
            if train_policy:
                loss.backward()
            self._record(stats, mb, t, lp.detach(), entropy, out)
            if self.critic is not None:
                self._critic_backward(stats, p, denom)
            results.append(
                MicroBatchResult(mb, lp.detach(), out.token_loss.detach(), out.masks, t["advantages"])
            )
        if self.world.distributed:
            # FSDP2 averaged the reduce-scattered gradients over each parameter's group (all dp x cp
            # ranks; the experts' copies under ep); the loss is already divided by the global
            # count, so undo that average.
            for module in (self.model, self.critic):
                for p in module.parameters() if module is not None else ():
                    if p.grad is not None:
                        p.grad.mul_(fsdp_group_size(p))
        if moe is not None:
            prepare_metrics = {**prepare_metrics, **moe.metrics()}
        return Accumulated(stats, results, global_tokens, prepare_metrics)

    def _critic_backward(self, stats: TokenStats, p: Prepared, denom: float) -> None:
        mask = p.t["loss_mask"]
        values = self._values(p.t, p.shard)
        loss, clipped = value_loss(values, p.old_values, p.returns, mask, self.config.critic.value_clip)
        ((loss * p.t["owned"]).sum() / denom).backward()
        mask = mask & p.t["owned"]
        rows = stats.rows(p.mb.env_names)[sample_index(p.mb.sample_lens, mask.device)]
        stats.add("critic/value_loss", rows, loss, mask)
        stats.add("critic/value_clipped", rows, clipped.float(), mask)
        stats.add("critic/value", rows, values.detach(), mask)

    def _record(
        self, stats: TokenStats, mb: MicroBatch, t: dict, lp: torch.Tensor, entropy, out: LossOutputs
    ) -> None:
        mask = t["loss_mask"] & t["owned"]
        rows = stats.rows(mb.env_names)[sample_index(mb.sample_lens, mask.device)]  # env row per token
        d = torch.where(mask, lp - t["logprobs"], 0.0)
        stats.add("loss", rows, out.token_loss, mask)
        stats.add("entropy", rows, entropy, mask)
        stats.add("mismatch_kl", rows, torch.exp(d) - 1 - d, mask)  # KL(sampler || trainer), k3 estimate
        stats.add("token_advantage", rows, t["advantages"], mask)
        for name, flag in out.masks.items():
            stats.add(name, rows, flag.float(), mask)
        for name, value in out.values.items():
            stats.add(name, rows, value, mask)

    def optimizer_step(self, train_policy: bool = True) -> dict[str, float]:
        out = {}
        parts = [("", self.model, self.optimizer, self.config.optim.max_norm, train_policy)]
        if self.critic is not None:
            parts.append(
                ("critic/", self.critic, self.critic_optimizer, self.config.critic.optim.max_norm, True)
            )
        for prefix, module, optimizer, max_norm, enabled in parts:
            grad_norm = float("nan")
            if enabled:
                grad_norm = self.world.host(clip_grad_norm(module.parameters(), max_norm))
                if math.isfinite(grad_norm):
                    optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            out[f"{prefix}grad_norm"] = grad_norm
        if train_policy:
            self.scheduler.step()
        return out

    def train_step(
        self, micro_batches: list[MicroBatch], step: int = 0
    ) -> tuple[dict[str, float], list[MicroBatchResult]]:
        t0 = time.perf_counter()
        if self.world.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        lr = self.scheduler.get_last_lr()[0]
        train_policy = self.policy_trains(step)
        acc = self.accumulate(micro_batches, step)
        results, global_tokens = acc.results, acc.global_tokens
        metrics = acc.stats.reduce(self.world)
        metrics.update(acc.metrics)
        # Every rank of a cp group holds its micro-batches' full token losses and tokens: count them once.
        lead = self.world.cp_rank == 0
        sums = self.world.scalars(0.0, sum(mb.num_tokens for mb in micro_batches) if lead else 0.0)
        for r in results if lead else ():
            sums[0] += r.token_loss.sum().double()
        loss_sum, tokens = self.world.host(all_reduce_sum(sums, self.world))
        loss = loss_sum / max(global_tokens, 1)
        if global_tokens == 0:
            # No sample to learn from (every one filtered or failed): the parameters stay as they
            # are (an AdamW step on zero gradients would still move them); the schedule goes on.
            self.optimizer.zero_grad(set_to_none=True)
            if self.critic_optimizer is not None:
                self.critic_optimizer.zero_grad(set_to_none=True)
            if train_policy:
                self.scheduler.step()
        elif not math.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            if self.critic_optimizer is not None:
                self.critic_optimizer.zero_grad(set_to_none=True)
            metrics["grad_norm"] = float("nan")
        else:
            metrics.update(self.optimizer_step(train_policy))
        if "kl_reward/samples" in metrics:
            self.kl = self.kl.update(metrics["kl_reward/kl_per_sample"], int(metrics["kl_reward/samples"]))
        elapsed = time.perf_counter() - t0
        metrics.update(
            {
                "loss": loss,
                "lr": lr if train_policy else 0.0,
                "loss_tokens": global_tokens,
                "tokens": tokens,
                "throughput/tokens_per_s": tokens / max(elapsed, 1e-9),
                "time/train": elapsed,
                "peak_memory_gb": peak_memory_gb(self.world),
            }
        )
        if self.critic is not None:
            metrics["critic/lr"] = self.config.critic.optim.lr
            metrics["critic/policy_trained"] = float(train_policy)
        return metrics, results
