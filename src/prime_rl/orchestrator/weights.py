"""Follow the trainer's published weights and make the inference servers serve the newest.

The trainer publishes the weights after step N as `<output_dir>/weights/step_<N>/`, and writes the
`READY` marker in it last. Invariant: the orchestrator's policy version only advances once every
server that is `up` has confirmed that it serves those weights; a server that cannot be reached is
marked down instead, and `health.py` brings it back on the current version before it gets work.
Loads happen under one lock, so a returning server and a new version never race.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx

from prime_rl.layout import latest_ready_step, step_dir
from prime_rl.orchestrator.client import Server, ServerPool

log = logging.getLogger(__name__)

LOAD_ROUTE = "/prime_rl/load_weights"


class WeightSyncError(RuntimeError):
    """An inference server could not load published weights."""


class WeightSync:
    def __init__(self, root: Path, pool: ServerPool, version: int = 0, timeout_s: float = 300.0):
        self.root = Path(root)
        self.pool = pool
        self.version = version
        self.timeout_s = timeout_s
        self.lock = asyncio.Lock()

    async def poll(self) -> int:
        """Load the newest published weights if they are newer than what is served; return the version."""
        newest = await asyncio.to_thread(latest_ready_step, self.root)
        if newest is not None and newest > self.version:
            async with self.lock:
                if newest > self.version:
                    await self.load([s for s in self.pool.servers if s.up], newest)
                    self.version = newest
        return self.version

    async def restore(self, server: Server, served: int | None) -> bool:
        """Bring a returning server (serving step `served`, None if unknown) onto the current version.

        Call with `lock` held; False if the server could not be reached. If the current version's
        folder is gone (the trainer keeps only its last few), every up server moves on to the newest
        published weights with it.
        """
        newest = await asyncio.to_thread(latest_ready_step, self.root)
        if newest is not None and newest > self.version and not step_dir(self.root, self.version).exists():
            unreachable = await self.load([*[s for s in self.pool.servers if s.up], server], newest)
            self.version = newest
            return server not in unreachable
        if self.version > 0 and served != self.version:
            return server not in await self.load([server], self.version)
        if self.version == 0 and served not in (None, 0):
            raise WeightSyncError(
                f"{server.root_url} serves the weights of step {served}, but this run has published none: "
                "it was loaded by another run; restart it so that it serves the base model"
            )
        return True

    async def load(self, servers: list[Server], step: int) -> list[Server]:
        """Make `servers` serve the weights of `step`; return those that could not be reached (now
        suspected, see `ServerPool.suspect`)."""
        path = str(step_dir(self.root, step).resolve())
        unreachable: list[Server] = []
        async with httpx.AsyncClient(timeout=self.timeout_s) as http:

            async def load(server: Server) -> None:
                try:
                    resp = await http.post(
                        f"{server.root_url}{LOAD_ROUTE}", json={"path": path, "step": step}
                    )
                except httpx.HTTPError as e:
                    log.warning(
                        "%s did not answer the weight reload of step %d: %r", server.root_url, step, e
                    )
                    self.pool.suspect(server)
                    unreachable.append(server)
                    return
                if resp.status_code != 200:
                    raise WeightSyncError(
                        f"{server.root_url} refused to load the weights of step {step} ({resp.status_code}): {resp.text[:300]}"
                    )

            await asyncio.gather(*(load(s) for s in servers))
        return unreachable
