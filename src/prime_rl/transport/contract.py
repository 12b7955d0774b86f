"""The run contract: what the orchestrator sends and what the trainer needs, checked where they meet.

Credit assignment is split across the two processes: the orchestrator computes each
rollout's scalar advantage, scores rewards and, with a teacher, a per-token distillation term; the
trainer turns them into per-token advantages (`trainer/rl/credit.py`). Some pairs of settings only
make sense together, and a user may start the two processes from configs written apart. So each
side declares the settings the other depends on, as the key that set them and its value, and
`problems` says, in one sentence per mismatch naming both keys, what cannot work.

Where it is checked: `rl` runs `problems` on the two halves of its config before it starts anything;
started by hand, the orchestrator sends its side in a `Hello` as soon as it starts (and in every
micro-batch), the trainer checks it on arrival, and on a mismatch writes a refusal
(`layout.refusal_path`) before it stops, which the orchestrator watches for: both stop with the
same line.

Invariant: this module imports nothing from the processes, so both (and `rl`) can use it.
"""

from __future__ import annotations

import msgspec


class Setting(msgspec.Struct, frozen=True):
    """One config setting, as the user wrote it: its full key and its value, for error messages."""

    key: str
    value: str

    @classmethod
    def of(cls, key: str, value: object) -> Setting:
        """The value as TOML writes it (true, 'text', 0.5)."""
        text = (
            str(value).lower()
            if isinstance(value, bool)
            else repr(value)
            if isinstance(value, str)
            else str(value)
        )
        return cls(key, text)

    def __str__(self) -> str:
        return f"'{self.key}' = {self.value}"


class OrchestratorSide(msgspec.Struct, frozen=True):
    """What the orchestrator's config promises about the data it sends."""

    session: str
    """Random per orchestrator start: a refusal names the session it answers."""
    seq_len: int
    """The longest micro-batch it packs."""
    trainer_ranks: int
    """The data-parallel trainer ranks it spreads micro-batches over (`orchestrator.trainer_ranks`)."""
    drops_uniform_groups: Setting | None = None
    """What drops groups whose rewards are all equal (dynamic sampling, the zero-advantage filter)."""
    advantage_scale: Setting | None = None
    """A factor other than 1 on every rollout advantage (a teacher's `advantage_weight`)."""
    expects_normalization: Setting | None = None
    """An advantage function defined with batch whitening after it (REINFORCE++-baseline)."""


class TrainerSide(msgspec.Struct, frozen=True):
    """What the trainer's config needs from the data it receives."""

    seq_len: int
    dp: int
    """Its data-parallel ranks (all ranks / cp)."""
    needs_every_group: Setting | None = None
    """An estimator with a critic: a critic fit only to groups whose rewards differ learns a biased
    value, and under GAE a group of equal rewards still has non-zero advantages."""
    normalizes: Setting | None = None
    """Batch normalization of the advantages, which undoes any scale on them."""


def problems(orchestrator: OrchestratorSide, trainer: TrainerSide) -> list[str]:
    """Every reason why this orchestrator cannot feed this trainer, one sentence each."""
    out = []
    if trainer.needs_every_group and orchestrator.drops_uniform_groups:
        out.append(
            f"{trainer.needs_every_group} trains the critic on every group, but "
            f"{orchestrator.drops_uniform_groups} drops groups whose rewards are all equal: turn one of them off"
        )
    if trainer.normalizes and orchestrator.advantage_scale:
        out.append(
            f"{trainer.normalizes} whitens the rollout advantages, which undoes {orchestrator.advantage_scale}: "
            "set one of them to its default"
        )
    if orchestrator.expects_normalization and not trainer.normalizes:
        out.append(
            f"{orchestrator.expects_normalization} is whitened over the step's batch by the trainer, but "
            "'trainer.advantage.batch_normalize' = 'none': set it to 'all' (or 'env')"
        )
    if orchestrator.seq_len > trainer.seq_len:
        out.append(
            f"'orchestrator.seq_len' = {orchestrator.seq_len} packs micro-batches longer than "
            f"'trainer.seq_len' = {trainer.seq_len}: set them equal"
        )
    if orchestrator.trainer_ranks != trainer.dp:
        out.append(
            f"'orchestrator.trainer_ranks' = {orchestrator.trainer_ranks} sends to that many data-parallel "
            f"trainer ranks, but the trainer has {trainer.dp} (its ranks / 'trainer.parallel.cp'): set them equal"
        )
    return out


class ContractError(ValueError):
    """The orchestrator's and the trainer's configs cannot work together."""


def check(orchestrator: OrchestratorSide, trainer: TrainerSide) -> None:
    found = problems(orchestrator, trainer)
    if found:
        raise ContractError(" ".join(p.rstrip(".") + "." for p in found))
