"""The weight broadcast's rendezvous: a key-value store only the run's processes can use.

torch's `TCPStore` answers anyone who reaches its port (`list_keys()`, `get()`, `set()`), so whatever
it holds, a prefix or a proof, is a neighbour's to read, and its keys are a neighbour's to overwrite:
the review joined a broadcast group as rank 0 that way. This store is torch's `Store` interface
(what a process group forms through) over our own TCP protocol, served by trainer rank 0.

Invariants:
- the server listens on the one interface it was given, never on every interface;
- a connection is used only after both ends proved, by challenge and response, that they hold the
  store's key (`secret.key("weights-store")`): a stranger reads, writes and waits on nothing, and a
  process answering on the port without the key is refused by the client before it sends a key;
- no key or value the store holds is a secret (only the ranks' addresses): it is the connection,
  not the content, that is guarded;
- a handshake takes at most `HANDSHAKE_S`, and at most `MAX_CONNECTIONS` connections are served at
  once, so strangers cannot hold the store's threads; refusals are logged at most once per 10 s.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from hashlib import sha256

import msgspec
import torch.distributed as dist

from prime_rl.runtime import secret

log = logging.getLogger("prime_rl.auth")

HELLO = b"prime-rl-store/1"
NONCE_BYTES = 32
HANDSHAKE_S = 5.0
MAX_CONNECTIONS = 64
MAX_FRAME = 1 << 20
"""The largest request or answer: the ranks' addresses (gloo) or NCCL's unique id, and more."""
UNKEYED = b"prime-rl-unkeyed"
"""The key without a run secret: the same protocol, proving nothing (loopback by hand)."""
LOG_EVERY_S = 10.0
OPS = ("set", "get", "wait", "check", "add", "compare_set", "append", "delete", "num_keys")  # Table's
TAG = 16


class StoreRefused(ConnectionError):
    """The peer did not prove it holds the store's key (or the key is not ours)."""


def store_key() -> bytes:
    return secret.key("weights-store") or UNKEYED


def _proof(key: bytes, side: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(key, side + server_nonce + client_nonce, sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            raise ConnectionError("the peer closed the connection")
        data += part
    return bytes(data)


class Channel:
    """Frames over a proven connection, each sealed with the session's key and a counter per
    direction: a process relaying the handshake between two of ours can read the addresses, but
    cannot change, drop, reorder or replay a frame unseen."""

    def __init__(self, sock: socket.socket, session: bytes, sends: bytes, receives: bytes):
        self.sock, self._session = sock, session
        self._sends, self._receives = sends, receives
        self._sent = self._received = 0

    def _tag(self, direction: bytes, count: int, data: bytes) -> bytes:
        return hmac.new(self._session, direction + count.to_bytes(8, "big") + data, sha256).digest()[:TAG]

    def send(self, message) -> None:
        data = msgspec.msgpack.encode(message)
        tag = self._tag(self._sends, self._sent, data)
        self._sent += 1
        self.sock.sendall(struct.pack(">I", len(data)) + data + tag)

    def receive(self):
        (n,) = struct.unpack(">I", _recv_exact(self.sock, 4))
        if n > MAX_FRAME:
            raise ConnectionError(f"a frame of {n} bytes (at most {MAX_FRAME})")
        data, tag = _recv_exact(self.sock, n), _recv_exact(self.sock, TAG)
        if not hmac.compare_digest(tag, self._tag(self._receives, self._received, data)):
            raise ConnectionError("a frame not sealed with the session's key")
        self._received += 1
        return msgspec.msgpack.decode(data)


@dataclass
class Table:
    """The store's keys and values, shared by every connection (and the trainer's own ranks)."""

    values: dict[str, bytes] = field(default_factory=dict)
    changed: threading.Condition = field(default_factory=threading.Condition)
    abandoned: dict[str, str] = field(default_factory=dict)  # prefix -> why (`abandon`)

    def set(self, key: str, value: bytes) -> None:
        with self.changed:
            self.values[key] = value
            self.changed.notify_all()

    def wait(self, keys: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while not all(k in self.values for k in keys):
                for prefix, why in self.abandoned.items():
                    if any(k.startswith(prefix) for k in keys):
                        raise RuntimeError(f"the update under {prefix} was abandoned: {why}")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [k for k in keys if k not in self.values]
                    raise TimeoutError(f"the store had no {missing} within {timeout_s:g}s")
                self.changed.wait(left)

    def get(self, key: str, timeout_s: float) -> bytes:
        self.wait([key], timeout_s)
        return self.values[key]

    def add(self, key: str, amount: int) -> int:
        with self.changed:
            value = int(self.values.get(key, b"0")) + amount
            self.values[key] = str(value).encode()
            self.changed.notify_all()
            return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self.changed:
            current = self.values.get(key)
            if (current is None and not expected) or current == expected:
                self.values[key] = desired
                self.changed.notify_all()
                return desired
            return current if current is not None else expected

    def append(self, key: str, value: bytes) -> None:
        with self.changed:
            self.values[key] = self.values.get(key, b"") + value
            self.changed.notify_all()

    def delete(self, key: str) -> bool:
        with self.changed:
            return self.values.pop(key, None) is not None

    def abandon(self, prefix: str, why: str) -> None:
        """Give up the update under `prefix` (a member refused it: its keys never come): every wait
        on its keys, now or later, raises at once."""
        with self.changed:
            self.abandoned[prefix] = why
            self.changed.notify_all()

    def drop(self, prefix: str) -> None:
        """Forget one update's keys (its group is gone)."""
        with self.changed:
            for key in [k for k in self.values if k.startswith(prefix)]:
                del self.values[key]
            self.abandoned.pop(prefix, None)

    def check(self, keys: list[str]) -> bool:  # (each look at the dict is atomic: no lock)
        return all(k in self.values for k in keys)

    def num_keys(self) -> int:
        return len(self.values)

    def serve(self, op: str, args: list):
        """One request from a client: the answer (a malformed one raises, answered as an error)."""
        if op not in OPS:
            raise ValueError(f"unknown store operation {op!r}")
        return getattr(self, op)(*args)


def _bytes(value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _seconds(timeout, default_s: float) -> float:
    if timeout is None:
        return default_s
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


class _Store(dist.Store):
    """torch's `Store` interface over `_call(op, args)`."""

    timeout_s: float

    def _call(self, op: str, args: list):
        raise NotImplementedError

    def set(self, key, value):
        self._call("set", [key, _bytes(value)])

    def get(self, key):
        return self._call("get", [key, self.timeout_s])

    def wait(self, keys, timeout=None):
        self._call("wait", [list(keys), _seconds(timeout, self.timeout_s)])

    def check(self, keys):
        return self._call("check", [list(keys)])

    def add(self, key, amount):
        return self._call("add", [key, int(amount)])

    def compare_set(self, key, expected, desired):
        return self._call("compare_set", [key, _bytes(expected), _bytes(desired)])

    def append(self, key, value):
        self._call("append", [key, _bytes(value)])

    def multi_get(self, keys):
        return [self.get(k) for k in keys]

    def multi_set(self, keys, values):
        for k, v in zip(keys, values, strict=True):
            self.set(k, v)

    def delete_key(self, key):
        return self._call("delete", [key])

    def num_keys(self):
        return self._call("num_keys", [])


class LocalStore(_Store):
    """The store as trainer rank 0 sees it: the server's table, without a socket."""

    def __init__(self, table: Table, timeout_s: float):
        super().__init__()
        self.table, self.timeout_s = table, timeout_s

    def _call(self, op: str, args: list):
        return self.table.serve(op, args)


class RemoteStore(_Store):
    """A client of a `StoreServer`: one proven connection per thread that uses it (a blocking wait
    in one thread never holds up another)."""

    def __init__(self, host: str, port: int, timeout_s: float, key: bytes | None = None):
        super().__init__()
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._key = key or store_key()
        self._local = threading.local()
        self._connection()  # fails now, not inside a process group, when the store is not ours

    def _connection(self) -> Channel:
        channel = getattr(self._local, "channel", None)
        if channel is None:
            channel = connect(self.host, self.port, self._key, min(self.timeout_s, 30.0))
            self._local.channel = channel
        return channel

    def _call(self, op: str, args: list):
        channel = self._connection()
        wait_s = args[-1] if op in ("get", "wait") else 0.0
        channel.sock.settimeout(wait_s + 30.0)
        channel.send([op, args])
        ok, answer = channel.receive()
        if not ok:
            raise (TimeoutError if answer.startswith("TimeoutError") else RuntimeError)(
                f"store {self.host}:{self.port}: {answer}"
            )
        return answer

    def close(self) -> None:
        channel = getattr(self._local, "channel", None)
        if channel is not None:
            channel.sock.close()
            self._local.channel = None


def _session(key: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return _proof(key, b"session", server_nonce, client_nonce)


def connect(host: str, port: int, key: bytes, timeout_s: float) -> Channel:
    """A connection to the store at `host:port` whose server proved it holds `key` (and to which
    this end proved it too); `StoreRefused` otherwise, having sent nothing derived from the key
    to a server that did not prove itself first."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.settimeout(HANDSHAKE_S)
        hello = _recv_exact(sock, len(HELLO) + NONCE_BYTES)
        if not hello.startswith(HELLO):
            raise StoreRefused(f"{host}:{port} is not a prime-rl store")
        server_nonce, client_nonce = hello[len(HELLO) :], os.urandom(NONCE_BYTES)
        sock.sendall(client_nonce)
        # The server proves itself first: a squatter gets a nonce, never a proof of ours.
        if not hmac.compare_digest(_recv_exact(sock, 32), _proof(key, b"server", server_nonce, client_nonce)):
            raise StoreRefused(f"the store at {host}:{port} is not this run's trainer's")
        sock.sendall(_proof(key, b"client", server_nonce, client_nonce))
        if _recv_exact(sock, 2) != b"ok":
            raise StoreRefused(f"the store at {host}:{port} refused this process's key")
    except (OSError, ConnectionError) as e:
        sock.close()
        if isinstance(e, StoreRefused):
            raise
        raise StoreRefused(f"the store at {host}:{port} did not complete the handshake ({e})") from None
    sock.settimeout(None)
    return Channel(sock, _session(key, server_nonce, client_nonce), b"c", b"s")


class StoreServer:
    """Trainer rank 0's store, for the whole run: a listening socket on `host` only, a thread that
    accepts, and a thread per proven connection."""

    def __init__(self, host: str, port: int, timeout_s: float, key: bytes | None = None):
        self.table = Table()
        self.timeout_s = timeout_s
        self._key = key or store_key()
        self._listener = socket.create_server((host, port), backlog=64)
        self.address = self._listener.getsockname()[:2]
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._refused, self._said = 0, 0.0
        self._closed = False
        threading.Thread(target=self._accept, name=f"weights-store {host}:{port}", daemon=True).start()

    def store(self) -> LocalStore:
        return LocalStore(self.table, self.timeout_s)

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                conn.close()  # strangers holding every slot cannot grow our threads
                self._refuse(peer, "too many connections")
                continue
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _refuse(self, peer, why: str) -> None:
        self._refused += 1
        now = time.monotonic()
        if now - self._said >= LOG_EVERY_S:
            log.warning(
                "weights store: refused %d connection(s) (the last from %s: %s)", self._refused, peer[0], why
            )
            self._refused, self._said = 0, now

    def _serve(self, conn: socket.socket, peer) -> None:
        try:
            with conn:
                channel = self._handshake(conn, peer)
                if channel is None:
                    return
                while True:
                    try:
                        op, args = channel.receive()
                    except (ConnectionError, OSError, ValueError, msgspec.DecodeError):
                        return
                    try:
                        answer = [True, self.table.serve(op, args)]
                    except Exception as e:  # a timeout or a malformed request: the client's error
                        answer = [False, f"{type(e).__name__}: {e}"]
                    channel.send(answer)
        except OSError:
            pass
        finally:
            self._slots.release()

    def _handshake(self, conn: socket.socket, peer) -> Channel | None:
        conn.settimeout(HANDSHAKE_S)  # the whole handshake: a trickling stranger is cut off
        deadline = time.monotonic() + HANDSHAKE_S
        try:
            server_nonce = os.urandom(NONCE_BYTES)
            conn.sendall(HELLO + server_nonce)
            client_nonce = _recv_exact(conn, NONCE_BYTES)
            conn.sendall(_proof(self._key, b"server", server_nonce, client_nonce))
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            given = _recv_exact(conn, 32)
        except (OSError, ConnectionError):
            self._refuse(peer, "no handshake")
            return None
        if not hmac.compare_digest(given, _proof(self._key, b"client", server_nonce, client_nonce)):
            self._refuse(peer, "no proof of the run's key")
            return None
        conn.sendall(b"ok")
        conn.settimeout(None)
        return Channel(conn, _session(self._key, server_nonce, client_nonce), b"s", b"c")

    def close(self) -> None:
        self._closed = True
        self._listener.close()
