"""The SFT objective of the trainer's step (`trainer/step.py`): cross-entropy on the completion
tokens, the per-token mean over the global batch.

Invariant: nothing of RL runs here (no estimator, credit, reference or critic): the step's global
normalization, FSDP, MoE bookkeeping, clipping and optimizer are the same as RL's.
"""

from __future__ import annotations

import torch

from prime_rl.trainer.batch import PackedBatch
from prime_rl.trainer.config import TrainingConfig
from prime_rl.trainer.logprobs import batch_logprobs
from prime_rl.trainer.model import build_model
from prime_rl.trainer.optim import build_optimizer, build_scheduler
from prime_rl.trainer.parallel.dist import World, all_reduce_sum
from prime_rl.trainer.step import Context, Part, train_step
from prime_rl.transport.messages import MicroBatch


class SFT:
    """The model being fine-tuned, its optimizer and schedule, and the SFT objective."""

    def __init__(self, config: TrainingConfig, world: World):
        self.config = config
        self.world = world
        self.model = build_model(config.model, world, key="model.name", lora=config.lora, seed=config.seed)
        self.optimizer = build_optimizer(self.model, config.optim)
        self.scheduler = build_scheduler(self.optimizer, config.scheduler, config.max_steps)

    @property
    def parts(self) -> list[Part]:
        return [Part("", self.model, self.optimizer, self.config.optim.max_norm)]

    def prepare(self, batches: list[PackedBatch]) -> tuple[list[PackedBatch], dict[str, float]]:
        return batches, {}

    def loss(self, b: PackedBatch, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
        with ctx.routing(b) as routing:
            lp, entropy = batch_logprobs(self.model, b, self.config.model.logprob_chunk_tokens)
        token_loss = torch.where(b.counted, -lp, 0.0)
        loss = token_loss.sum() / max(ctx.totals.loss_tokens, 1.0)
        aux = ctx.aux_loss(routing, b)
        rows = b.per_token(ctx.stats.rows(b.env_names))
        ctx.stats.add("loss", rows, token_loss, b.counted)
        ctx.stats.add("entropy", rows, entropy, b.counted)
        return (loss if aux is None else loss + aux), token_loss.detach().sum().double()

    def metrics(self, records: list[torch.Tensor], ctx: Context) -> dict[str, float]:
        """The mean cross-entropy per completion token over the global batch (each token is owned
        by one rank)."""
        local = self.world.scalars(0.0)
        for r in records:
            local[0] += r
        (loss_sum,) = self.world.host(all_reduce_sum(local, self.world))
        return {"loss": loss_sum / max(ctx.totals.loss_tokens, 1.0)}

    def train_step(self, micro_batches: list[MicroBatch], step: int = 0) -> tuple[dict[str, float], list]:
        batches = [PackedBatch.of(mb, self.world) for mb in micro_batches]
        moe = (self.config.moe.replay, self.config.moe.aux_loss_coef)
        return train_step(self, batches, self.parts, self.scheduler, self.world, moe=moe)
