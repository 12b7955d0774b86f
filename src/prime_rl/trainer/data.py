"""This rank's micro-batches, one step at a time, from the transport.

Invariant: `get(step)` returns exactly the micro-batches of that step (all `count` of them, in
index order, each validated), from an orchestrator whose side of the run contract agrees with this
trainer's (`prime_rl.transport.contract`): a `Hello` or a micro-batch whose side does not stops the trainer
with `ContractError`, after writing the refusal that stops that orchestrator too, and a micro-batch
without that side is refused by the receiver (`transport.base.NoContract`): none goes unchecked.
Messages of earlier steps are ones the orchestrator re-sent after a restart and are skipped; a
repeated index is dropped, so no step is trained twice or on a mix.
With context parallelism only the group's cp rank 0 reads the transport (the orchestrator sends to
data-parallel ranks); `share_with_cp_group` hands the same micro-batches to the group's other ranks.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import torch.distributed as dist

from prime_rl.trainer.parallel.dist import World
from prime_rl.transport.base import Receiver, TransportError
from prime_rl.transport.contract import ContractError, OrchestratorSide, TrainerSide, problems
from prime_rl.transport.file_transport import write_atomic
from prime_rl.transport.messages import Hello, MicroBatch, decode, encode

log = logging.getLogger("prime_rl.trainer")


MAX_STEPS_AHEAD = 64
"""Micro-batches of later steps are kept until their step; one further ahead than this is refused, so
a sender cannot fill the trainer's memory with steps it will never reach."""


class BadMicroBatch(TransportError):
    """A micro-batch that cannot be trained on (inconsistent fields, longer than seq_len)."""


class SampleTooLong(BadMicroBatch):
    """A sample longer than the model's context: positions the model never learned (a restart would
    meet the same sample, so it needs the user)."""


def check_sample_lengths(mb: MicroBatch, context: int | None, model: str) -> None:
    """SampleTooLong when a sample of `mb` is longer than `context` (the model's positions). The
    micro-batch itself may be longer: packed samples restart their positions."""
    if context is None or not mb.sample_lens or max(mb.sample_lens) <= context:
        return
    i = max(range(len(mb.sample_lens)), key=mb.sample_lens.__getitem__)
    env = mb.env_names[i] if i < len(mb.env_names) else "?"
    raise SampleTooLong(
        f"a sample of env '{env}' (step {mb.header.step}) has {mb.sample_lens[i]} tokens, more than the "
        f"{context} positions of trainer.model.name = '{model}' (max_position_embeddings); shorten the "
        "env's prompts or max_tokens, or train a model with a longer context"
    )


class OutsideTheModel(BadMicroBatch):
    """A token id outside the model's vocabulary, or a position outside its context: on a GPU an
    index out of range is a device assert that loses the process; here it is one line (a restart
    would meet the same micro-batch, so it needs the user)."""


def check_token_ids(mb: MicroBatch, vocab_size: int | None, context: int | None, model: str) -> None:
    """OutsideTheModel when a token id of `mb` is not in [0, vocab_size) or a position is not in
    [0, context), naming the micro-batch, the sample's env and the value."""
    arrays = mb.arrays()
    where = f"micro-batch {mb.index} of step {mb.header.step} (rank {mb.header.rank})"
    for name, values, bound, what in (
        ("input_ids", arrays["input_ids"], vocab_size, "vocabulary"),
        ("position_ids", arrays["position_ids"], context, "positions (max_position_embeddings)"),
    ):
        if bound is None or not len(values):
            continue
        bad = np.flatnonzero((values < 0) | (values >= bound))
        if len(bad):
            token = int(bad[0])
            sample = int(np.searchsorted(np.cumsum(mb.sample_lens), token, side="right"))
            env = mb.env_names[sample] if sample < len(mb.env_names) else "?"
            raise OutsideTheModel(
                f"{where}: {name}[{token}] = {int(values[token])} (a sample of env '{env}') is outside the "
                f"{bound} {what} of trainer.model.name = '{model}'; the sampler's model and tokenizer must "
                "be the trainer's"
            )


class StepReceiver:
    def __init__(self, receiver: Receiver, seq_len: int, side: TrainerSide, refusal: Path | None = None):
        self.receiver = receiver
        self.seq_len = seq_len
        self.side = side
        """This trainer's side of the run contract."""
        self.refusal = refusal
        """Where a refusal goes, for the orchestrator to read."""
        self._ahead: dict[int, dict[int, MicroBatch]] = {}
        self._agreed: OrchestratorSide | None = None

    def check(self, orchestrator: OrchestratorSide) -> None:
        """Stop (ContractError) if this orchestrator's config cannot feed this trainer's."""
        if orchestrator == self._agreed:
            return
        found = problems(orchestrator, self.side)
        if not found:
            self._agreed = orchestrator
            return
        message = " ".join(p.rstrip(".") + "." for p in found)
        if self.refusal is not None:
            record = {"session": orchestrator.session, "message": message}
            write_atomic(self.refusal, json.dumps(record).encode())
        raise ContractError(message)

    def get(self, step: int) -> list[MicroBatch]:
        got = self._ahead.pop(step, {})
        count = next(iter(got.values())).count if got else None
        skipped = 0
        while count is None or len(got) < count:
            mb = self.receiver.recv()
            if isinstance(mb, Hello):
                self.check(mb.orchestrator)
                continue
            if not isinstance(mb, MicroBatch):
                raise BadMicroBatch(f"expected micro-batches, got a {type(mb).__name__}")
            self.check(mb.orchestrator)
            s = mb.header.step
            if s < step:
                skipped += 1
                continue
            try:
                mb.validate(seq_len=self.seq_len)
            except ValueError as e:
                raise BadMicroBatch(str(e)) from None
            if s > step:
                if s > step + MAX_STEPS_AHEAD:
                    raise BadMicroBatch(
                        f"a micro-batch of step {s} arrived while the trainer is at step {step}: more than "
                        f"{MAX_STEPS_AHEAD} steps ahead, which no orchestrator sends (max_async_level is far "
                        "smaller); refused rather than kept in memory"
                    )
                self._ahead.setdefault(s, {})[mb.index] = mb
                continue
            count = mb.count
            got.setdefault(mb.index, mb)
        if skipped:
            log.info("skipped %d re-sent micro-batches of steps before %d", skipped, step)
        return [got[i] for i in range(count)]


def share_with_cp_group(micro_batches: list[MicroBatch] | None, world: World) -> list[MicroBatch]:
    """The cp leader's micro-batches on every rank of its group (msgpack bytes over the group)."""
    if world.cp == 1:
        return micro_batches
    box = [[encode(mb) for mb in micro_batches] if world.cp_rank == 0 else None]
    dist.broadcast_object_list(box, src=world.cp_leader, group=world.cp_group)
    return micro_batches if world.cp_rank == 0 else [decode(b) for b in box[0]]
