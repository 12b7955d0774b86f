"""Signed requests: the run's clients prove they hold a key derived from the run secret, and the
secret itself never travels.

A request carries `Authorization: PrimeRL-HMAC id=<who>,t=<unix seconds>,n=<nonce>,s=<signature>`,
the signature an HMAC-SHA-256, under the caller's request key, of the method, the path (with its
query), the time, the nonce, the caller's id and a digest of the body. The server accepts a
signature only once (it keeps the nonces it saw) and only within `WINDOW_S` of its own clock.

Before a client sends a signed request to a server, the server proves (at `PROVE_PATH`, which needs
no signature and changes nothing) that it holds the same key, for a fresh challenge; a process that
answers on the server's port without it gets no signed request, and the client says so in one line
(`ServerNotOurs`). Nothing is sent to the open routes (`/health` ...).

Invariants:
- what crosses the network is a signature over one request: replayed to the server that saw it, it
  is refused (its nonce); changed (another path, body or caller), it does not verify; after
  `WINDOW_S`, it is refused whatever it is. Nothing in it gives a key;
- each use of the secret has its own derived key: requests (`requests`), the server's proofs
  (`prove`), and, for a tenant, `tenant/<name>` under the server's own secret;
- without a secret, nothing is signed and every request is accepted (loopback by hand).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import parse_qs, quote, urlsplit

from prime_rl.auth import tenant
from prime_rl.runtime import secret

SCHEME = "PrimeRL-HMAC"
WINDOW_S = 120.0
"""How far a signature's time may be from the server's clock (nodes' clocks differ a little)."""
PROVE_PATH = "/prime_rl/prove"
CHECKED_FOR_S = 30.0
"""A client checks a server's proof again after this long: a server restarted in between, and a
process that took its port meanwhile, are found within it."""
OWNER = ""
"""The id of the server's owner: the run whose secret the server was started with."""


class ServerNotOurs(ConnectionError):
    """The process answering at a server's address did not prove it holds the run's key."""


ORCHESTRATOR = "orchestrator"
"""The id the run's orchestrator signs with: the one caller that may set the run's version back
(`load_weights` with `rewind`)."""


def request_key(identity: str = OWNER) -> bytes | None:
    """The request key of `identity` under this process's secret (None without a secret, or for
    an id it does not know)."""
    if identity == OWNER:
        return secret.key("requests")
    if identity == ORCHESTRATOR:
        return secret.key("requests/orchestrator")
    return tenant.key_for(identity)  # a shared server's tenant (None: no such caller)


def _prove_key(key: bytes) -> bytes:
    return hmac.new(key, b"prove", hashlib.sha256).digest()


def body_digest(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


def _message(method: str, target: str, t: int, nonce: str, identity: str, digest: bytes) -> bytes:
    return f"{method.upper()}\n{target}\n{t}\n{nonce}\n{identity}\n".encode() + digest


def sign(key: bytes, method: str, target: str, body: bytes, identity: str = OWNER) -> str:
    """The `Authorization` header of one request (`target`: its path and query)."""
    t, nonce = int(time.time()), os.urandom(16).hex()
    mac = hmac.new(key, _message(method, target, t, nonce, identity, body_digest(body)), hashlib.sha256)
    return f"{SCHEME} id={identity},t={t},n={nonce},s={mac.hexdigest()}"


def prove(key: bytes, challenge: str) -> str:
    """The server's answer to a client's challenge."""
    return hmac.new(_prove_key(key), challenge.encode(), hashlib.sha256).hexdigest()


def prove_request(identity: str = OWNER) -> tuple[str, str]:
    """A fresh challenge, and the proof request's path and query for it."""
    challenge = os.urandom(16).hex()
    return challenge, f"{PROVE_PATH}?c={challenge}&id={quote(identity)}"


def check_proof(key: bytes, challenge: str, answer: str | None, where: str) -> None:
    if not (answer and hmac.compare_digest(answer, prove(key, challenge))):
        raise ServerNotOurs(
            f"{where} did not prove it holds this run's key: another process may have its port, "
            f"or it was started with another secret; nothing was sent to it"
        )


def proof_answer(query: str, keys=None) -> tuple[int, dict]:
    """A server's answer to `GET PROVE_PATH?c=<challenge>&id=<caller>`: (status, JSON body)."""
    asked = challenge_of(query)
    if asked is None:
        return 400, {"error": "expected ?c=<challenge>&id=<caller>"}
    key = (keys or request_key)(asked[1])
    if key is None:  # no secret (nothing is signed), or a caller it does not know
        return 404, {"error": "this server holds no key for that caller"}
    return 200, {"proof": prove(key, asked[0])}


def parse(header: str | None) -> dict[str, str] | None:
    if not header or not header.startswith(SCHEME + " "):
        return None
    fields = dict(part.partition("=")[::2] for part in header[len(SCHEME) + 1 :].split(","))
    return fields if {"id", "t", "n", "s"} <= fields.keys() else None


@dataclass
class Verifier:
    """A server's check of signed requests. `keys(identity)`: the request key of a caller, None for
    a caller it does not know."""

    keys: object = field(default=lambda identity: request_key(identity))
    window_s: float = WINDOW_S
    _seen: set[str] = field(default_factory=set)
    _order: deque = field(default_factory=deque)
    """(when, nonce) in the order they came."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def check(self, method: str, target: str, header: str | None, digest: bytes) -> tuple[str | None, str]:
        """(the caller's id, "") for a good signature, (None, why) otherwise."""
        fields = parse(header)
        if fields is None:
            return None, "no signature" if not header else "not a signature of ours"
        key = self.keys(fields["id"])
        if key is None:
            return None, f"unknown caller {fields['id'][:40]!r}"
        try:
            t = int(fields["t"])
        except ValueError:
            return None, "a malformed signature"
        now = time.time()
        if abs(now - t) > self.window_s:
            return None, f"a signature {now - t:+.0f} s from this server's clock (at most {self.window_s:g})"
        expected = hmac.new(
            key, _message(method, target, t, fields["n"], fields["id"], digest), hashlib.sha256
        )
        if not hmac.compare_digest(fields["s"], expected.hexdigest()):
            return None, "a wrong signature"
        with self._lock:
            if fields["n"] in self._seen:
                return None, "a signature seen before (a replay)"
            # Forget nonces older than the window (in the order they came: O(1) a request); a
            # replay of one is refused by its time anyway.
            while self._order and self._order[0][0] < now - 2 * self.window_s:
                self._seen.discard(self._order.popleft()[1])
            self._seen.add(fields["n"])
            self._order.append((now, fields["n"]))
        return fields["id"], ""


def challenge_of(query: str) -> tuple[str, str] | None:
    """The challenge and the caller's id in a proof request's query, None for an absurd one."""
    fields = parse_qs(query, keep_blank_values=True)
    challenge, identity = (fields.get("c") or [""])[0], (fields.get("id") or [OWNER])[0]
    return (challenge, identity) if 0 < len(challenge) <= 128 and len(identity) <= 128 else None


def origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"
