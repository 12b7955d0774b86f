"""ZeroMQ PUSH/PULL transport: the orchestrator pushes, each trainer rank pulls from its own port.

Back-pressure: each socket queues at most `hwm` messages. When the trainer falls behind, the
orchestrator's send waits instead of piling data up in memory, and fails with `TransportTimeout`
after `timeout_s` if nobody takes the message (the trainer is gone or stuck).
"""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from prime_rl.transport.base import TransportTimeout, check_run
from prime_rl.transport.config import TransportConfig, resolve_port
from prime_rl.transport.messages import Message, decode, encode


def rank_address(config: TransportConfig, rank: int, run_id: str) -> str:
    return f"tcp://{config.host}:{resolve_port(config, run_id) + rank}"


def _setup(sock: zmq.Socket, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)  # close() of a sender sets its own linger: see `close`
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)


class _Pusher:
    """A PUSH socket bound to one rank's address, in a context of its own so that `close` can wait
    for queued messages to be delivered (by terminating that context)."""

    context_class: type[zmq.Context] = zmq.Context

    def __init__(self, address: str, hwm: int = 16, timeout_s: float = 600.0):
        self.address = address
        self.timeout_s = timeout_s
        self._ctx = self.context_class()
        self._sock = self._ctx.socket(zmq.PUSH)
        _setup(self._sock, hwm)
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise TransportTimeout(f"cannot bind {address}: {e} (is another run using this port?)") from None

    def _timeout(self, message: Message) -> TransportTimeout:
        return TransportTimeout(
            f"no trainer took a message on {self.address} for {self.timeout_s:.0f} s "
            f"(step {message.header.step}, rank {message.header.rank}): is the trainer running and connected?"
        )

    def close(self, linger_s: float | None = None) -> None:
        """Close; by default wait up to `timeout_s` for queued messages to reach the trainer.

        A send returns once zmq has queued the message, so closing without linger could drop the
        last step's micro-batches. Pass `linger_s=0` when giving up (an error is already raised).
        """
        linger = self.timeout_s if linger_s is None else linger_s
        self._sock.close(linger=int(linger * 1000))
        self._ctx.term()  # blocks until the queue is delivered or the linger time is up


class ZmqSender(_Pusher):
    """Sends messages to one trainer rank, blocking while the queue is full (back-pressure)."""

    def send(self, message: Message) -> None:
        try:
            self._sock.send(encode(message), copy=False)
        except zmq.Again:
            raise self._timeout(message) from None


class AsyncZmqSender(_Pusher):
    """Like `ZmqSender`, for the orchestrator's event loop: waiting for the trainer never blocks it."""

    context_class = zmq.asyncio.Context

    async def send(self, message: Message) -> None:
        try:
            await asyncio.wait_for(self._sock.send(encode(message), copy=False), self.timeout_s)
        except (TimeoutError, zmq.Again):
            raise self._timeout(message) from None

    async def send_when_connected(self, message: Message) -> None:
        """Send without a time limit: it waits for the trainer to connect (cancel it to give up)."""
        await self._sock.send(encode(message), copy=False)


class ZmqReceiver:
    """Connects a PULL socket to one rank's address and returns that run's messages in order."""

    def __init__(self, address: str, run_id: str, hwm: int = 16, timeout_s: float = 600.0):
        self.address = address
        self.run_id = run_id
        self.timeout_s = timeout_s
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        _setup(self._sock, hwm)
        self._sock.connect(address)

    def recv(self, timeout_s: float | None = None) -> Message:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not self._sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise TransportTimeout(
                f"no message from the orchestrator on {self.address} for {timeout:.0f} s: "
                "is the orchestrator running, and are the inference servers producing rollouts?"
            )
        data = self._sock.recv(copy=False)
        return check_run(decode(data.buffer), self.run_id, self.address)

    def close(self) -> None:
        self._sock.close()
