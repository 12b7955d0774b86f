"""ZeroMQ PUSH/PULL transport: the orchestrator pushes, each trainer rank pulls from its own port.

Back-pressure: each socket queues at most `hwm` messages. When the trainer falls behind, the
orchestrator's send waits instead of piling data up in memory, and fails with `TransportTimeout`
after `timeout_s` if nobody takes the message (the trainer is gone or stuck).

Security: with a run secret both ends use CURVE (`curve.py`): a process without the secret can
neither take the orchestrator's micro-batches nor hand the trainer its own. The trainer's socket
drops a connection that sends a message over `max_message_bytes` (set from its seq_len: messages
never fill its memory), and the orchestrator refuses to send one, so that no micro-batch is lost
to that limit silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from prime_rl.runtime import secret
from prime_rl.transport import curve
from prime_rl.transport.base import TransportError, TransportTimeout, check_run
from prime_rl.transport.config import TransportConfig, resolve_port
from prime_rl.transport.messages import Message, MicroBatch, decode, encode


def rank_address(config: TransportConfig, rank: int, run_id: str) -> str:
    return f"tcp://{config.host}:{resolve_port(config, run_id) + rank}"


def _setup(sock: zmq.Socket, hwm: int) -> None:
    sock.setsockopt(zmq.LINGER, 0)  # close() of a sender sets its own linger: see `close`
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)


def _what(message: Message) -> str:
    h = message.header
    what = f"micro-batch {message.index}" if isinstance(message, MicroBatch) else type(message).__name__
    return f"{what} of step {h.step} (rank {h.rank})"


class _Pusher:
    """A PUSH socket bound to one rank's address, in a context of its own so that `close` can wait
    for queued messages to be delivered (by terminating that context), and so that, with a run
    secret, its ZAP handler (`curve.Gate`) serves this socket alone."""

    context_class: type[zmq.Context] = zmq.Context

    def __init__(
        self, address: str, hwm: int = 16, timeout_s: float = 600.0, max_message_bytes: int | None = None
    ):
        self.address = address
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        """The receiving trainer's limit (`messages.max_message_bytes`); None: not checked."""
        self._ctx = self.context_class()
        self._sock = self._ctx.socket(zmq.PUSH)
        _setup(self._sock, hwm)
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        keys = curve.run_keys()
        self._gate = curve.Gate(self._sock, keys, address) if keys is not None else None
        self.refusals = self._gate.refusals if self._gate is not None else None
        """Connections refused for want of the run's secret (None without a secret)."""
        try:
            self._sock.bind(address)
        except zmq.ZMQError as e:
            self._close(0)
            raise TransportTimeout(f"cannot bind {address}: {e} (is another run using this port?)") from None

    def _encode(self, message: Message) -> bytes:
        data = encode(message)
        if self.max_message_bytes is not None and len(data) > self.max_message_bytes:
            raise TransportError(
                f"{_what(message)} for {self.address} encodes to {len(data)} bytes, more than the "
                f"{self.max_message_bytes} a trainer of this seq_len accepts (its socket would drop it): "
                "are its routes or env names far larger than they should be?"
            )
        return data

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
        self._close(self.timeout_s if linger_s is None else linger_s)

    def _close(self, linger_s: float) -> None:
        if self._gate is not None:
            self._gate.close()
        self._sock.close(linger=int(linger_s * 1000))
        self._ctx.term()  # blocks until the queue is delivered or the linger time is up


class ZmqSender(_Pusher):
    """Sends messages to one trainer rank, blocking while the queue is full (back-pressure)."""

    def send(self, message: Message) -> None:
        try:
            self._sock.send(self._encode(message), copy=False)
        except zmq.Again:
            raise self._timeout(message) from None


class AsyncZmqSender(_Pusher):
    """Like `ZmqSender`, for the orchestrator's event loop: waiting for the trainer never blocks it."""

    context_class = zmq.asyncio.Context

    async def send(self, message: Message) -> None:
        try:
            await asyncio.wait_for(self._sock.send(self._encode(message), copy=False), self.timeout_s)
        except (TimeoutError, zmq.Again):
            raise self._timeout(message) from None

    async def send_when_connected(self, message: Message) -> None:
        """Send without a time limit: it waits for the trainer to connect (cancel it to give up)."""
        await self._sock.send(self._encode(message), copy=False)


CURVE_FRAMING_BYTES = 64
"""What CURVE adds to a message on the wire (33 bytes: command name, nonce, MAC), which zmq's size
limit counts: the receiver allows it on top of `max_message_bytes`, which the sender checks."""
RECONNECT_S = 1.0
"""How long after a handshake that zmq gives up on (the peer speaks another mechanism, or refused
our key) the receiver connects again: it finds the orchestrator once the orchestrator holds the
address, without spinning on a process that squats it."""


class ZmqReceiver:
    """Connects a PULL socket to one rank's address and returns that run's messages in order.

    While it waits it reads the socket's monitor: refused handshakes (a process there without the
    run's secret) are logged as `curve.Refusals` does, and where zmq would not try that address
    again, it connects again `RECONNECT_S` later."""

    def __init__(
        self,
        address: str,
        run_id: str,
        hwm: int = 16,
        timeout_s: float = 600.0,
        max_message_bytes: int | None = None,
    ):
        self.address = address
        self.run_id = run_id
        self.timeout_s = timeout_s
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        _setup(self._sock, hwm)
        if max_message_bytes is not None:
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + CURVE_FRAMING_BYTES)
        keys = curve.run_keys()
        if keys is not None:
            curve.make_client(self._sock, keys)
        self._monitor = curve.watch(self._sock, curve.REFUSED)
        variables = f"{secret.ENV} or {secret.FILE_ENV}"
        if keys is not None:
            cause = "the process there does not hold this run's secret"
            hint = f"is another process using this port, or was the orchestrator started without {variables}?"
        else:
            cause = "the process there uses a run secret, and this trainer has none"
            hint = f"give the trainer the orchestrator's ({variables})"
        self.refusals = curve.Refusals(
            lambda n, reason: (
                f"refused {n} connection(s) to {address}: {cause} (the last one: {reason}); {hint}"
            )
        )
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._reconnect_at: float | None = None
        self._sock.connect(address)

    def recv(self, timeout_s: float | None = None) -> Message:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            if self._reconnect_at is not None and now >= self._reconnect_at:
                self._reconnect_at = None
                with contextlib.suppress(zmq.ZMQError):  # (not connected any more: nothing to undo)
                    self._sock.disconnect(self.address)
                self._sock.connect(self.address)
            wake = deadline if self._reconnect_at is None else min(deadline, self._reconnect_at)
            ready = dict(self._poller.poll(max(0, int((wake - now) * 1000))))
            if self._monitor in ready:
                self._read_monitor()
            if self._sock in ready:
                break
            if time.monotonic() >= deadline:
                raise TransportTimeout(
                    f"no message from the orchestrator on {self.address} for {timeout:.0f} s: "
                    "is the orchestrator running, and are the inference servers producing rollouts?"
                )
        data = self._sock.recv(copy=False)
        return check_run(decode(data.buffer), self.run_id, self.address)

    def _read_monitor(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)
            self.refusals.note(event)
            if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # (zmq retries only that one)
                self._reconnect_at = time.monotonic() + RECONNECT_S

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close()
        self._sock.close()
        self.refusals.flush()
