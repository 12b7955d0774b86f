"""What every transport offers, and the errors it raises.

Invariant: a transport delivers each message at most once and in the order it was sent, or raises;
it never drops a message silently. A receiver only returns messages of its own run, and only
micro-batches that carry the orchestrator's side of the run contract (`prime_rl.transport.contract`), so
that the trainer checks it on every one.
"""

from __future__ import annotations

from typing import Protocol

from prime_rl.transport.messages import Message, MicroBatch


class TransportError(RuntimeError):
    """A transport could not deliver or receive a message."""


class TransportTimeout(TransportError):
    """The peer did not take or send a message in time (it is gone, stuck or not started)."""


class ForeignRunError(TransportError):
    """A message arrived from another run (two runs share a port or a folder)."""


class NoContract(TransportError):
    """A micro-batch without the orchestrator's side of the run contract: not from an orchestrator
    of this version, and one the trainer could not check."""


class Sender(Protocol):
    def send(self, message: Message) -> None: ...

    def close(self) -> None: ...


class Receiver(Protocol):
    def recv(self, timeout_s: float | None = None) -> Message: ...

    def close(self) -> None: ...


def check_run(message: Message, run_id: str, source: str) -> Message:
    """`message`, if it is of run `run_id` and, a micro-batch, carries the run contract; `source`
    (its address or file) names it in the error otherwise."""
    if message.header.run_id != run_id:
        raise ForeignRunError(
            f"received a message of run '{message.header.run_id}' from {source}, but this is run '{run_id}': "
            "another run is sending to the same address or folder; give each run its own transport port "
            "(transport.port) or output_dir"
        )
    if isinstance(message, MicroBatch) and message.orchestrator is None:
        h = message.header
        raise NoContract(
            f"micro-batch {message.index} of step {h.step} (rank {h.rank}) from {source} carries no "
            "orchestrator side of the run contract, which every orchestrator sends: refused rather than "
            "trained on unchecked (is an older orchestrator, or some other process, sending to this address?)"
        )
    return message
