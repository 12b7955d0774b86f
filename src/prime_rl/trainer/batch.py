"""One packed micro-batch on the training device: what every stage of a step reads.

A `MicroBatch` arrives as bytes; `PackedBatch.of` turns it into typed tensors once, with what the
stages would otherwise each rebuild: the sample of each token, the tokens this rank counts (context
parallelism), the tokens of real samples (not the filler that evens out ranks), each sample's loss
tokens, and the shard with its attention plan.

Invariant: a `PackedBatch` is never changed after it is built. Per-token tensors have shape [T]
(the micro-batch's length), per-sample ones [S]; counts that decide shapes are host numbers, so
reading them costs no device sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prime_rl.trainer.parallel.context_parallel import SequenceShard, shard_micro_batch
from prime_rl.trainer.parallel.dist import World
from prime_rl.transport.messages import MicroBatch


def sample_index(sample_lens: list[int], device: torch.device) -> torch.Tensor:
    """[T]: the sample each token of a packed micro-batch belongs to (its size known on the host)."""
    return torch.repeat_interleave(
        torch.arange(len(sample_lens), device=device),
        torch.tensor(sample_lens, device=device),
        output_size=sum(sample_lens),
    )


def loss_tokens_per_sample(loss_mask: np.ndarray, sample_lens: list[int]) -> tuple[int, ...]:
    """Each sample's loss tokens, counted on the host."""
    ends = np.cumsum(sample_lens)
    return tuple(int(loss_mask[e - n : e].sum()) for e, n in zip(ends, sample_lens, strict=True))


@dataclass(frozen=True)
class PackedBatch:
    """One micro-batch's tensors on the device, and its samples' bookkeeping."""

    source: MicroBatch
    """The message it was built from (its header and index, for the token export)."""
    input_ids: torch.Tensor
    """[T] int64."""
    position_ids: torch.Tensor
    """[T] int64, restarting at 0 in each sample."""
    loss_mask: torch.Tensor
    """[T] bool: the tokens the policy sampled, which train."""
    sampling_logprobs: torch.Tensor
    """[T] float32: the sampler's logprob of each loss token (0 elsewhere)."""
    owned: torch.Tensor
    """[T] bool: the tokens this rank counts; with context parallelism each token is owned by one
    rank of its group, and every rank holds the whole micro-batch."""
    counted: torch.Tensor
    """[T] bool: loss tokens this rank counts (`loss_mask & owned`)."""
    real: torch.Tensor
    """[T] bool: tokens of real samples; false on a filler micro-batch's pad tokens."""
    sample_of_token: torch.Tensor
    """[T] int64: the sample each token belongs to."""
    sample_lens: list[int]
    env_names: list[str]
    """[S] the env of each sample."""
    loss_tokens: tuple[int, ...]
    """[S] each sample's loss tokens (over the whole sample, whatever rank owns which)."""
    rollout_advantages: torch.Tensor
    """[S] float32: each sample's advantage from the orchestrator's advantage function."""
    rewards: torch.Tensor
    """[S] float32: each sample's rollout reward."""
    temperature: float
    """The sampling temperature; the trainer's logprobs are taken at it."""
    shard: SequenceShard
    """This rank's positions of the micro-batch and their attention plan."""
    head_rows: torch.Tensor
    """[R] int64: the shard's local positions that predict a loss token, where the logprobs are
    computed (found on the host: its size decides shapes)."""
    token_advantages: torch.Tensor | None = None
    """[T] float32: per-token terms added after normalization (distillation); None: none."""
    routes: torch.Tensor | None = None
    """[T, layers, top-k] int64: the sampler's experts, for router replay; None: none."""

    @classmethod
    def of(cls, mb: MicroBatch, world: World) -> PackedBatch:
        dev = world.device
        a = mb.arrays()
        mask = a["loss_mask"].astype(bool)
        shard = shard_micro_batch(mb.sample_lens, world.cp, world.cp_rank, world.cp_group, dev)
        predicts_loss = np.append(mask[1:], False)  # position t predicts token t + 1
        loss_mask = torch.from_numpy(mask).to(dev)
        owned = shard.owned_tokens(dev)
        samples = sample_index(mb.sample_lens, dev)
        real = torch.full_like(loss_mask, not mb.filler)
        return cls(
            source=mb,
            input_ids=torch.from_numpy(a["input_ids"].astype("int64")).to(dev),
            position_ids=torch.from_numpy(a["position_ids"].astype("int64")).to(dev),
            loss_mask=loss_mask,
            sampling_logprobs=torch.from_numpy(a["logprobs"].copy()).to(dev),
            owned=owned,
            counted=loss_mask & owned,
            real=real,
            sample_of_token=samples,
            sample_lens=list(mb.sample_lens),
            env_names=list(mb.env_names),
            loss_tokens=loss_tokens_per_sample(mask, mb.sample_lens),
            rollout_advantages=torch.tensor(mb.advantages, dtype=torch.float32, device=dev),
            rewards=torch.tensor(mb.rewards, dtype=torch.float32, device=dev),
            temperature=mb.temperature,
            shard=shard,
            head_rows=torch.from_numpy(np.flatnonzero(shard.take_on_host(predicts_loss))).to(dev),
            token_advantages=(
                torch.from_numpy(a["token_advantages"].copy()).to(dev) if "token_advantages" in a else None
            ),
            routes=torch.from_numpy(a["routes"].astype("int64")).to(dev) if "routes" in a else None,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.sample_of_token)

    @property
    def samples_with_loss(self) -> int:
        """Samples with at least one loss token."""
        return sum(1 for n in self.loss_tokens if n > 0)

    def per_token(self, per_sample: torch.Tensor) -> torch.Tensor:
        """[S, ...] -> [T, ...]: each sample's value on every one of its tokens."""
        return per_sample[self.sample_of_token]

    def per_sample_sum(self, per_token: torch.Tensor) -> torch.Tensor:
        """[T] -> [S]: each sample's sum over its tokens."""
        out = per_token.new_zeros(len(self.sample_lens))
        return out.index_add(0, self.sample_of_token, per_token)
