"""The door of the inference pool: servers that join the run while it runs, and leave it.

Routes, JSON, served by the orchestrator's own event loop (`orchestrator.pool`):
- `POST /pool/join {"url": <the server's base URL>}`: the server becomes a member, down and joining
  until the health monitor has loaded the run's current weights (or adapter) on it; then it gets
  groups like the others. A server that registers again (restarted at the same address) is checked
  again the same way. Answers `{"step": <the run's current version>}`; 409 with the reason when the
  server would refuse this run's weights (another output dir, another secret).
- `POST /pool/leave {"url", "drain_s"}`: the server gets no new group from now on; its groups in
  flight have `drain_s` (at most `pool.max_drain_s`) to finish, and those still running then are
  handed back: they fail as `ServerSilentError` and their examples go to the next dispatch. Then it
  is removed, and the answer `{"handed_back": H, "seconds": S}` tells it that it may stop.
- `GET /pool`: the members, each with its state, groups and served weight version.

Invariants: with a run secret, every route wants it (`Authorization: Bearer`); a request without it
or with another gets 401, changes nothing, and is one line in the log (at most one per
`REFUSAL_LOG_EVERY_S`, with a count of the others). Nothing a leaving server ran is lost or counted
twice: a group either finishes (and is trained, filtered or failed as any other) or is handed back.
The address is written to `<output_dir>/orchestrator/pool.json` once the door is open, and
`"finished": true` beside it once the run is over.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from prime_rl.auth import signing
from prime_rl.orchestrator.config import PoolConfig
from prime_rl.orchestrator.loop.servers import Server, ServerPool
from prime_rl.orchestrator.loop.weights import WeightSync
from prime_rl.orchestrator.loop.weights_dir import check_weights_dir
from prime_rl.runtime import secret
from prime_rl.runtime.layout import pool_path
from prime_rl.transport.file_transport import write_atomic

log = logging.getLogger("prime_rl.orchestrator")

REFUSAL_LOG_EVERY_S = 10.0
MAX_BODY_BYTES = 64 * 1024
DRAIN_POLL_S = 0.1


def base_url(url: str) -> str:
    """A server's OpenAI base URL from what it sent: `http://host:port` or `.../v1`."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


class Registry:
    def __init__(
        self,
        config: PoolConfig,
        pool: ServerPool,
        weights: WeightSync,
        output_dir: Path,
        on_leave: Callable[[Server], int],
    ):
        self.config = config
        self.pool = pool
        self.weights = weights
        self.output_dir = Path(output_dir)
        self.on_leave = on_leave
        """Hands back a leaving server's training groups still in flight (`Scheduler.abandon`)."""
        self.url: str | None = None
        self._runner: web.AppRunner | None = None
        self._refused = {"unsaid": 0, "last": None}
        self._verifier = signing.Verifier()

    async def start(self) -> str:
        """Open the door; returns its URL (also written to `pool.json`)."""
        secret.require_for_bind(self.config.host, "the orchestrator's pool")
        app = web.Application(middlewares=[self._authenticated], client_max_size=MAX_BODY_BYTES)
        app.add_routes(
            [
                web.post("/pool/join", self._join),
                web.post("/pool/leave", self._leave),
                web.get("/pool", self._members),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        await web.SockSite(self._runner, sock).start()
        host = self.config.host
        if host in ("0.0.0.0", "::"):
            host = socket.gethostname()  # a wildcard: the machine's name is where others reach it
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        await asyncio.to_thread(
            write_atomic, pool_path(self.output_dir), json.dumps({"url": self.url}).encode()
        )
        log.info("inference servers join this run at %s (orchestrator.pool)", self.url)
        return self.url

    async def close(self, finished: bool = False) -> None:
        """Close the door; `finished`: the run is over, which the members that read `pool.json`
        take as their cue to stop (a run that stops early, to be resumed, keeps them)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if finished and self.url is not None:
            body = json.dumps({"url": self.url, "finished": True}).encode()
            await asyncio.to_thread(write_atomic, pool_path(self.output_dir), body)

    # ---------------------------------------------------------------- routes

    @web.middleware
    async def _authenticated(self, request: web.Request, handler):
        if secret.value() is None:
            return await handler(request)
        if request.path == signing.PROVE_PATH:
            status, body = signing.proof_answer(request.query_string, self._verifier.keys)
            return web.json_response(body, status=status)
        given = request.headers.get("Authorization")
        body = await request.read() if signing.parse(given) else b""  # bounded by client_max_size
        caller, why = self._verifier.check(request.method, request.raw_path, given, signing.body_digest(body))
        if caller == signing.OWNER:
            return await handler(request)
        self._log_refusal(f"{request.method} {request.path} from {request.remote}: {why or 'not the run'}")
        return web.json_response(
            {
                "error": f"{why or 'not the run'}: this run's pool takes only servers that hold the run's "
                f"secret (start them with {secret.FILE_ENV}=<the run's output_dir>/{secret.FILE_NAME})"
            },
            status=401,
        )

    async def _join(self, request: web.Request) -> web.Response:
        try:
            url = base_url(str((await request.json())["url"]))
            if not url.startswith(("http://", "https://")):
                raise ValueError
        except Exception:
            return web.json_response({"error": 'expected JSON {"url": "http://host:port"}'}, status=400)
        candidate = Server(url, up=False)
        try:
            await check_weights_dir(candidate, self.output_dir, adapter=self.weights.adapter is not None)
        except Exception as e:  # one line each side: here, and in the server's answer
            log.warning("inference server %s cannot join the pool: %s", candidate.root_url, e)
            return web.json_response({"error": str(e)}, status=409)
        server = self.pool.join(url)
        log.info(
            "inference server %s registers: it gets work once it serves step %d",
            server.root_url,
            self.weights.version,
        )
        return web.json_response({"step": self.weights.version})

    async def _leave(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
            url, drain_s = base_url(str(body["url"])), float(body.get("drain_s", self.config.max_drain_s))
        except Exception:
            return web.json_response({"error": 'expected JSON {"url": ..., "drain_s": ...}'}, status=400)
        server = self.pool.find(url)
        if server is None:
            return web.json_response({"error": f"{url} is not a member of this run's pool"}, status=404)
        drain_s = max(0.0, min(drain_s, self.config.max_drain_s))
        t0 = time.monotonic()
        server.draining = True
        log.info(
            "inference server %s is leaving: no new groups; those in flight have %.0f s to finish",
            server.root_url,
            drain_s,
        )
        while server.inflight and time.monotonic() - t0 < drain_s:
            await asyncio.sleep(DRAIN_POLL_S)
        handed_back = self.on_leave(server) if server.inflight else 0
        self.pool.remove(server)
        seconds = time.monotonic() - t0
        log.info(
            "inference server %s left the pool after %.1f s: %d group(s) handed back",
            server.root_url,
            seconds,
            handed_back,
        )
        return web.json_response({"handed_back": handed_back, "seconds": seconds})

    async def _members(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "version": self.weights.version,
                "members": [
                    {
                        "url": s.base_url,
                        "state": s.state,
                        "groups": s.groups,
                        "inflight": s.inflight,
                    }
                    for s in self.pool.servers
                ],
            }
        )

    def _log_refusal(self, what: str) -> None:
        self._refused["unsaid"] += 1
        now = time.monotonic()
        last = self._refused["last"]
        if last is not None and now - last < REFUSAL_LOG_EVERY_S:
            return
        more = self._refused["unsaid"] - 1
        log.warning("pool: refused %s%s", what, f" (and {more} more since the last line)" if more else "")
        self._refused.update(unsaid=0, last=now)
