"""CURVE on the zmq transport: only the processes of one run can exchange its micro-batches.

With a run secret (`prime_rl.runtime.secret`), both keypairs derive from it: the server's (the orchestrator's
bound PUSH socket) and the client's (each trainer rank's PULL socket). The server completes a
handshake only with a peer that proves it holds the client key (a ZAP handler checks it), and the
client only with a peer that holds the server key (CURVE itself: it encrypts its hello to that key).
So a neighbour without the secret who connects to the orchestrator's port receives nothing, and one
who binds the port first sends the trainer nothing; the traffic is encrypted as well.

Invariants:
- without a secret, no socket uses CURVE (runs started by hand work as before);
- every refused connection is counted and logged, in one line at most every `REFUSAL_LOG_S`
  seconds per socket (the first at once), so that a flood of attempts does not flood the log;
- the server's ZAP handler and its log run in a thread of their own (`Gate`), never on the
  orchestrator's event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.auth.base import Authenticator
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from prime_rl.runtime import secret

log = logging.getLogger("prime_rl.transport")

ZAP_DOMAIN = "prime-rl"
REFUSAL_LOG_S = 10.0
"""At most one line per socket this often about refused connections (with how many since the last)."""

REFUSED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
"""Monitor events of a connection whose handshake failed: the peer lacks the run's keys (or died
mid-handshake, which is counted too)."""


@dataclass(frozen=True)
class RunKeys:
    """The run's two CURVE keypairs, Z85-encoded."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def _keypair(label: str) -> tuple[bytes, bytes] | None:
    raw = secret.key(label)  # 32 bytes: any of them is a valid Curve25519 secret key
    if raw is None:
        return None
    secret_key = z85.encode(raw)
    return zmq.curve_public(secret_key), secret_key


def run_keys() -> RunKeys | None:
    """The keys of this run, None without a secret."""
    server, client = _keypair("zmq-curve-server"), _keypair("zmq-curve-client")
    if server is None or client is None:
        return None
    return RunKeys(*server, *client)


def make_client(sock: zmq.Socket, keys: RunKeys) -> None:
    """Make `sock` (before it connects) complete handshakes only with the run's server."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


_monitors = itertools.count()


def watch(sock: zmq.Socket, events: int) -> zmq.Socket:
    """A blocking (never asyncio) PAIR socket that receives `sock`'s monitor `events`."""
    # (A name never used before: an earlier socket's monitor may still hold its name a while.)
    address = f"inproc://prime-rl-monitor-{next(_monitors)}"
    sock.monitor(address, events)
    watcher = sock.context.socket(zmq.PAIR, socket_class=zmq.Socket)
    watcher.linger = 0
    watcher.connect(address)
    return watcher


def why(event: dict) -> str:
    """What a refused handshake's monitor event says about the peer."""
    kind, value = event["event"], event["value"]
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "the server refused the client key"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "it does not use CURVE, or it does and this end does not"
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "its keys are not this run's"
    return "the handshake failed"


class Refusals:
    """Counts refused connections and logs them: the first at once, then at most one line per
    `every_s` seconds with the count since the last line; `flush` logs what is left."""

    def __init__(self, line: Callable[[int, str], str], every_s: float = REFUSAL_LOG_S):
        self._line = line
        """The log line for `count` refusals, the last of which said `why`."""
        self.every_s = every_s
        self.total = 0
        self._pending = 0
        self._why = ""
        self._last: float | None = None

    def note(self, event: dict) -> None:
        self.total += 1
        self._pending += 1
        self._why = why(event)
        if self._last is None or time.monotonic() - self._last >= self.every_s:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            log.warning(self._line(self._pending, self._why))
            self._pending, self._last = 0, time.monotonic()


class _OnlyTheRunsClient:
    """ZAP credentials provider: accepts the run's client key and nothing else."""

    def __init__(self, client_public: bytes):
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.client_public  # (public keys: nothing to hide in the comparison's timing)


class Gate:
    """The server side of CURVE on one bound socket: configures it (before it binds) and runs, in
    its own thread, the context's ZAP handler (pyzmq's `Authenticator`, with a callback that
    accepts only the run's client key) and the log of refused connections (from the socket's
    monitor: a peer without CURVE, or with the wrong keys, fails before ZAP is asked).

    One per context: ZAP is served on the context's fixed inproc address."""

    def __init__(self, sock: zmq.Socket, keys: RunKeys, address: str):
        sock.curve_server = True
        sock.curve_secretkey = keys.server_secret
        sock.zap_domain = ZAP_DOMAIN.encode()
        # With the domain enforced, a handshake while no ZAP handler runs (after `close` stopped it)
        # fails, instead of passing without the client key being checked.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        self._sock = sock
        self._auth = Authenticator(sock.context)
        self._auth.configure_curve_callback(ZAP_DOMAIN, _OnlyTheRunsClient(keys.client_public))
        self._auth.start()
        self._monitor = watch(sock, REFUSED | zmq.EVENT_MONITOR_STOPPED)
        self.refusals = Refusals(
            lambda n, reason: (
                f"refused {n} connection(s) to {address} from a process without this run's "
                f"secret (the last one: {reason}); a trainer started without {secret.ENV} or "
                f"{secret.FILE_ENV} is refused too"
            )
        )
        self._thread = threading.Thread(target=self._serve, name=f"zmq-gate {address}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        # pyzmq's ZAP handler is a coroutine; this loop only drives it (our callback never waits).
        loop = asyncio.new_event_loop()
        poller = zmq.Poller()
        poller.register(self._auth.zap_socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._auth.zap_socket in ready:
                    loop.run_until_complete(
                        self._auth.handle_zap_message(self._auth.zap_socket.recv_multipart())
                    )
                if self._monitor in ready:
                    event = recv_monitor_message(self._monitor)
                    if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                        return
                    self.refusals.note(event)
        finally:
            loop.close()

    def close(self) -> None:
        """Stop the thread (call it from the thread that closes the socket, before the socket)."""
        self._sock.disable_monitor()  # the thread receives MONITOR_STOPPED and returns
        self._thread.join()
        self._monitor.close()
        self._auth.stop()
        self.refusals.flush()
