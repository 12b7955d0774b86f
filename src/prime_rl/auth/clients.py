"""The run's HTTP clients sign their requests (`signing.py`): httpx through `Signed` (an
`httpx.Auth`), aiohttp through `sign_headers` after `prove_server`.

Invariant: a client sends a signed request to an address only after the server there proved,
within the last `CHECKED_FOR_S`, that it holds the same key; it sends nothing at all to the open
routes but the request itself (no `Authorization`).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import httpx

from prime_rl.auth import signing, tenant

OPEN_PATHS = frozenset({"/health", "/ping", "/version", signing.PROVE_PATH})
"""Routes our servers answer without a signature: nothing is sent to them."""

_proven: dict[tuple[str, str, str], float] = {}
"""(origin, caller id, the key's fingerprint) -> when its server last proved it holds the key."""
_locks: dict[tuple[str, str, str], asyncio.Lock] = {}


def _where(url: str, identity: str, key: bytes) -> tuple[str, str, str]:
    return signing.origin(url), identity, hashlib.sha256(key).hexdigest()[:16]


class ServerNotOurs(httpx.ConnectError, signing.ServerNotOurs):
    """A server's address answered without the run's key (callers see a server that is down)."""


def _fresh(where: tuple[str, str, str]) -> bool:
    return time.monotonic() - _proven.get(where, -1e9) < signing.CHECKED_FOR_S


def _checked(key: bytes, challenge: str, response_json, where: str) -> None:
    try:
        answer = response_json().get("proof")
    except Exception:
        answer = None
    try:
        signing.check_proof(key, challenge, answer, where)
    except signing.ServerNotOurs as e:
        raise ServerNotOurs(str(e)) from None


class Signed(httpx.Auth):
    """Signs every request but those to the open routes, after the server proved itself."""

    requires_request_body = True
    requires_response_body = True

    def __init__(self, key: bytes | None = None, identity: str = signing.OWNER):
        self.key = key if key is not None else signing.request_key(identity)
        self.identity = identity

    def auth_flow(self, request: httpx.Request):
        if self.key is None or request.url.path in OPEN_PATHS:
            yield request
            return
        where = _where(str(request.url), self.identity, self.key)
        if not _fresh(where):
            challenge, target = signing.prove_request(self.identity)
            answer = yield httpx.Request("GET", where[0] + target)
            _checked(self.key, challenge, answer.json, f"the server at {where[0]}")
            _proven[where] = time.monotonic()
        yield sign_request(request, self.key, self.identity)


def sign_request(request, key: bytes, identity: str = signing.OWNER):
    """`request` (an httpx one, or of a library with its interface) signed in place; without the
    server's proof first: for a server the caller already trusts, as in a test."""
    target = request.url.raw_path.decode()
    request.headers["Authorization"] = signing.sign(key, request.method, target, request.content, identity)
    return request


def caller(identity: str = signing.OWNER) -> tuple[str, bytes | None]:
    """Who this process signs as, and with which key: a tenant of a shared server with its tenant
    key (`PRIME_RL_TENANT_KEY_FILE`, whatever `identity` it asks for: a tenant has no other), else
    `identity` under the run secret (no key without a secret)."""
    mine = tenant.mine()
    if mine is not None:
        return mine
    return identity, signing.request_key(identity)


def auth(identity: str = signing.OWNER) -> Signed | None:
    """The auth of this process's clients to the run's servers (None without a secret)."""
    identity, key = caller(identity)
    return Signed(key, identity) if key is not None else None


async def prove_server(session, url: str, key: bytes, identity: str = signing.OWNER) -> None:
    """With aiohttp: have the server at `url` prove itself, unless it did within `CHECKED_FOR_S`
    (one check at a time per server, however many requests wait on it)."""
    where = _where(url, identity, key)
    if _fresh(where):
        return
    lock = _locks.setdefault(where, asyncio.Lock())
    async with lock:
        if _fresh(where):
            return
        challenge, target = signing.prove_request(identity)
        async with session.get(where[0] + target) as response:
            body = await response.read()
        _checked(key, challenge, lambda: json.loads(body), f"the server at {where[0]}")
        _proven[where] = time.monotonic()


def sign_headers(key: bytes, method: str, url: str, body: bytes, identity: str = signing.OWNER) -> dict:
    """The `Authorization` header of one aiohttp request to `url`."""
    from yarl import URL

    target = URL(url).raw_path_qs
    return {"Authorization": signing.sign(key, method, target, body, identity)}


def forget(url: str) -> None:
    """Check the server at `url` again before the next request (it went away and came back)."""
    for where in [w for w in _proven if w[0] == signing.origin(url)]:
        del _proven[where]
