"""The inference servers as the loop sees them: health and load.

Invariant: a group's rollouts all go to one server (they share a prompt, so its prefix cache helps),
and each new group goes to the server with the fewest rollouts in flight among those that are `up`
(see `health.py` for who sets `up`). A group holds its server's in-flight count from dispatch to
return (`scheduler.run_on`), so that the next dispatch sees its load.

In engine mode (`orchestrator.engine`) the pool is one server, vLLM's engine in this process: it is
up once started, says its served step itself, and loads weights by a call (`weights.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from prime_rl import secret, tls
from prime_rl.engine.local import LocalEngine
from prime_rl.orchestrator.config import ClientConfig

log = logging.getLogger(__name__)


class InferenceUnavailable(RuntimeError):
    """An inference server never became healthy."""


@dataclass(eq=False)  # identity: two servers are never the same one
class Server:
    base_url: str
    """OpenAI base URL, e.g. http://127.0.0.1:8000/v1."""
    inflight: int = 0
    up: bool = True
    """Whether new work may go to it: False from a suspected failure until it is back on the
    current weights."""
    engine: LocalEngine | None = None
    """vLLM's engine in this process, when this server is that engine (engine mode)."""

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/").removesuffix("/v1")


ENGINE_URL = "http://engine.in-process/v1"
"""The base URL that names the in-process engine (nothing listens there: its client calls it)."""


class ServerPool:
    def __init__(self, config: ClientConfig, engine: LocalEngine | None = None):
        self.config = config
        if engine is not None:
            self.servers = [Server(ENGINE_URL, engine=engine)]
        else:
            self.servers = [Server(url) for url in config.base_urls]
        self.suspected = asyncio.Event()
        """Set when a server is suspected to be down: wakes the health monitor."""

    def pick(self) -> Server | None:
        """The up server with the fewest rollouts in flight, or None while none is up."""
        up = [s for s in self.servers if s.up]
        return min(up, key=lambda s: s.inflight) if up else None

    async def pick_when_up(self, poll_s: float = 0.2) -> Server:
        while (server := self.pick()) is None:
            await asyncio.sleep(poll_s)
        return server

    @property
    def inflight(self) -> int:
        return sum(s.inflight for s in self.servers)

    def suspect(self, server: Server) -> None:
        """Keep new work off `server` until the health monitor has checked it."""
        server.up = False
        self.suspected.set()

    async def wait_healthy(self) -> None:
        await asyncio.gather(
            *(
                wait_healthy(s.root_url, self.config.health_timeout_s)
                for s in self.servers
                if s.engine is None
            )
        )


async def wait_healthy(
    root_url: str, timeout_s: float, first_delay_s: float = 0.5, max_delay_s: float = 2.0
) -> None:
    """Poll `<root_url>/health` with exponential back-off; raise `InferenceUnavailable` at the deadline."""
    deadline = time.monotonic() + timeout_s
    delay, last = first_delay_s, "no answer"
    warned = False
    async with httpx.AsyncClient(timeout=5.0, verify=tls.context(), headers=secret.headers()) as http:
        while True:
            try:
                resp = await http.get(f"{root_url}/health")
                if resp.status_code == 200:
                    return
                last = f"HTTP {resp.status_code}"
            except httpx.HTTPError as e:
                last = f"{type(e).__name__}"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise InferenceUnavailable(
                    f"inference server {root_url} was not healthy after {timeout_s:.0f} s (last: {last}); "
                    "is `uv run inference` running there, and is client.base_urls right?"
                )
            if not warned and time.monotonic() > deadline - timeout_s + 5:
                log.info("waiting for inference server %s (%s)", root_url, last)
                warned = True
            await asyncio.sleep(min(delay, remaining))
            delay = min(delay * 2, max_delay_s)
