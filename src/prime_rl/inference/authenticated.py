"""The inference server's door: every request but a few open routes is signed by the run
(`auth/signing.py`), checked before any route, vLLM's own included, sees it.

Invariants: a refused request changes nothing and reads no more than its headers (a body is read
only under a well-formed signature, and at most `MAX_SIGNED_BODY` of it); each refusal is one log
line, at most one per `REFUSAL_LOG_EVERY_S`; without a run secret every request passes (loopback
by hand).
"""

from __future__ import annotations

import json
import sys
import time

from prime_rl.auth import signing
from prime_rl.inference import tenants
from prime_rl.runtime import secret

OPEN_PATHS = frozenset({"/health", "/ping", "/version"})
"""Open without a signature: whether the server is up and its version; none serves a completion,
changes anything or names anything (`/metrics` names the adapters and the model: it is signed)."""

MAX_SIGNED_BODY = 64 << 20
"""The largest body read before its signature is checked (a stranger's 10 GB is refused unread)."""

REFUSAL_LOG_EVERY_S = 10.0
_refusals: dict = {"unsaid": 0, "last": None}


def log_refusal(what: str) -> None:
    """One line per refusal, and at most one per `REFUSAL_LOG_EVERY_S` (with a count of the others),
    so that a flood of bad requests cannot flood the log."""
    _refusals["unsaid"] += 1
    now = time.monotonic()
    if _refusals["last"] is not None and now - _refusals["last"] < REFUSAL_LOG_EVERY_S:
        return
    more = _refusals["unsaid"] - 1
    also = f" (and {more} more since the last line)" if more else ""
    print(f"prime_rl: refused {what}{also}", file=sys.stderr, flush=True)
    _refusals.update(unsaid=0, last=now)


async def _answer(send, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Authenticated:
    """ASGI middleware: with a run secret, every request but `OPEN_PATHS` must be signed with the
    run's request key (`auth/signing.py`), or gets 401 before any route sees it; `PROVE_PATH`
    proves to a client that this server holds the key. (Outermost, so vLLM's own routes are
    covered too.) The caller's id is put in the scope as `prime_rl.caller`."""

    def __init__(self, app, verifier: signing.Verifier | None = None):
        self.app = app
        self.verifier = verifier or signing.Verifier()

    async def __call__(self, scope, receive, send):
        if scope["type"] not in ("http", "websocket") or secret.value() is None:
            return await self.app(scope, receive, send)
        path, query = scope["path"], scope.get("query_string", b"").decode("latin-1")
        if path == signing.PROVE_PATH and scope["type"] == "http":
            return await _answer(send, *signing.proof_answer(query, self.verifier.keys))
        if path in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"").decode("latin-1")
        body = b""
        if scope["type"] == "http":
            body = await _read_body(receive, MAX_SIGNED_BODY) if signing.parse(given) else b""
            if body is None:
                return await _answer(send, 413, {"error": f"a body over {MAX_SIGNED_BODY} bytes"})
        target = scope.get("raw_path", path.encode()).decode("latin-1") + (f"?{query}" if query else "")
        method = scope.get("method", "GET")
        caller, why = self.verifier.check(method, target, given, signing.body_digest(body))
        if caller is None:
            client = (scope.get("client") or ("?", 0))[0]
            log_refusal(f"{method} {path} from {client}: {why}")
            if scope["type"] == "websocket":
                return await send({"type": "websocket.close", "code": 1008})
            return await _answer(send, 401, {"error": f"this server takes only signed requests ({why})"})
        scope = {**scope, "prime_rl.caller": caller}
        if caller not in (signing.OWNER, signing.ORCHESTRATOR):  # a tenant of a shared server
            why = tenants.refusal(scope, body)
            if why is not None:
                log_refusal(f"{method} {path} from tenant {caller!r}: {why}")
                return await _answer(send, 403, {"error": why})
        if scope["type"] == "websocket":
            return await self.app(scope, receive, send)
        replayed = False

        async def again():
            nonlocal replayed
            if replayed:
                return await receive()  # (a disconnect)
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, again, send)


async def _read_body(receive, limit: int) -> bytes | None:
    """A request's whole body, None past `limit` bytes."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)
