"""The inference pool as the loop sees it: its members, their health and their load.

Invariant: a group's rollouts all go to one server (they share a prompt, so its prefix cache helps),
and each new group goes to the server with the fewest rollouts in flight among those that are `up`
and not draining (see `health.py` for who sets `up`). A group holds its server's in-flight count from
dispatch to return (`scheduler.run_on`), so that the next dispatch sees its load.

Members come and go: those of `client.base_urls` (or, in engine mode, vLLM's engine in this process,
which is up once started, says its served step itself and loads weights by a call, `weights.py`) are
there from the start; a server that registers while the run runs (`registry.py`) joins down and
`joining`, and gets work once the health monitor has loaded the current weights on it; one that
leaves drains (no new groups) and is then removed, its groups given back (`left`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from prime_rl.auth import clients
from prime_rl.engine.local import ENGINE_URL, LocalEngine
from prime_rl.orchestrator.config import ClientConfig
from prime_rl.runtime import tls

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
    joined: bool = False
    """Registered while the run runs (not one of `client.base_urls`): one that vanishes is removed,
    and comes back by registering again."""
    joining: bool = False
    """Registered while the run runs, and not yet serving the current weights."""
    draining: bool = False
    """Leaving: no new groups; those in flight may finish."""
    left: bool = False
    """Removed from the pool (it left, or registered again at another address)."""
    groups: int = 0
    """Groups dispatched to it so far (training and evaluation)."""
    step: int | None = None
    """The step of the weights it was last seen serving (None: not looked at yet)."""

    @property
    def lost(self) -> bool:
        """Whether its work dies with it: its groups that failed whole are dispatched again (vLLM's
        engine in this process, whose death this process sees, or a server that leaves the pool:
        stopped by its scheduler, its vLLM may go before it has drained)."""
        return self.left or self.draining or (self.engine is not None and self.engine.stopped)

    @property
    def state(self) -> str:
        """serving, joining, draining or down."""
        if self.draining:
            return "draining"
        if self.joining:
            return "joining"
        return "serving" if self.up else "down"

    @property
    def name(self) -> str:
        """host:port, or "engine" for vLLM's engine in this process (metrics, the step line)."""
        if self.engine is not None:
            return "engine"
        return self.root_url.split("://", 1)[-1]

    @property
    def root_url(self) -> str:
        return self.base_url.removesuffix("/").removesuffix("/v1")


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
        up = [s for s in self.servers if s.up and not s.draining]
        return min(up, key=lambda s: s.inflight) if up else None

    def find(self, base_url: str) -> Server | None:
        return next((s for s in self.servers if s.base_url == base_url), None)

    def join(self, base_url: str) -> Server:
        """A server registered at `base_url`: a new member, down until the health monitor has
        loaded the current weights on it. One already there (restarted at the same address)
        is checked again the same way."""
        server = self.find(base_url)
        if server is None:
            server = Server(base_url, up=False)
            self.servers.append(server)
        server.joined, server.joining, server.draining = True, True, False
        self.suspect(server)
        return server

    def remove(self, server: Server) -> None:
        """`server` is no longer a member: no work, no checks, no weights; its groups that come back
        failed whole are dispatched again (`Server.lost`)."""
        server.up, server.left = False, True
        if server in self.servers:
            self.servers.remove(server)

    def counts(self) -> dict[str, int]:
        """How many members serve, join, drain and are down now."""
        states = [s.state for s in self.servers]
        return {k: states.count(k) for k in ("serving", "joining", "draining", "down")}

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
    async with httpx.AsyncClient(timeout=5.0, verify=tls.context(), auth=clients.auth()) as http:
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
