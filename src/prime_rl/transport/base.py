"""What every transport offers, and the errors it raises.

Invariant: a transport delivers each message at most once and in the order it was sent, or raises;
it never drops a message silently. A receiver only returns messages of its own run.
"""

from __future__ import annotations

from typing import Protocol

from prime_rl.transport.messages import Message


class TransportError(RuntimeError):
    """A transport could not deliver or receive a message."""


class TransportTimeout(TransportError):
    """The peer did not take or send a message in time (it is gone, stuck or not started)."""


class ForeignRunError(TransportError):
    """A message arrived from another run (two runs share a port or a folder)."""


class Sender(Protocol):
    def send(self, message: Message) -> None: ...

    def close(self) -> None: ...


class Receiver(Protocol):
    def recv(self, timeout_s: float | None = None) -> Message: ...

    def close(self) -> None: ...


def check_run(message: Message, run_id: str, source: str) -> Message:
    if message.header.run_id != run_id:
        raise ForeignRunError(
            f"received a message of run '{message.header.run_id}' from {source}, but this is run '{run_id}': "
            "another run is sending to the same address or folder; give each run its own transport port "
            "(transport.port) or output_dir"
        )
    return message
