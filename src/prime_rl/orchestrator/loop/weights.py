"""Follow the trainer's published weights and make the inference servers serve the newest.

The trainer publishes the weights after step N as `<output_dir>/weights/step_<N>/`, and writes the
`READY` marker in it last. Invariant: the orchestrator's policy version only advances once every
server that is `up` has confirmed that it serves those weights; a server that cannot be reached is
marked down instead, and `health.py` brings it back on the current version before it gets work.
Loads happen under one lock, so a returning server and a new version never race.

With the trainer's collective broadcast, a step folder holds no weights, only a `BROADCAST` marker:
the servers got the weights from the trainer before it was written. A server that serves the step
(or a newer one: the next broadcast may already have reached it) counts as loaded; one that does not
is marked down, and becomes up again once a later broadcast, which carries the full weights, reached it.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx

from prime_rl.layout import BROADCAST, READY, latest_ready_step, step_dir
from prime_rl.orchestrator.loop.servers import Server, ServerPool

log = logging.getLogger(__name__)

LOAD_ROUTE = "/prime_rl/load_weights"
WEIGHTS_ROUTE = "/prime_rl/weights"
UNKNOWN = -1
"""Served step of a server that is healthy but has no weights route (a plain vLLM server)."""


async def served_step(http: httpx.AsyncClient, server: Server) -> int | None:
    """The step of the weights `server` serves, UNKNOWN if it cannot say, None if it does not answer."""
    try:
        resp = await http.get(f"{server.root_url}{WEIGHTS_ROUTE}")
        if resp.status_code == 200:
            return int(resp.json()["step"])
        if resp.status_code == 404 and (await http.get(f"{server.root_url}/health")).status_code == 200:
            return UNKNOWN
    except (httpx.HTTPError, ValueError, KeyError):
        pass
    return None


class WeightSyncError(RuntimeError):
    """An inference server could not load published weights."""


class WeightSync:
    def __init__(self, root: Path, pool: ServerPool, version: int = 0, timeout_s: float = 300.0):
        self.root = Path(root)
        self.pool = pool
        self.version = version
        self.timeout_s = timeout_s
        self.lock = asyncio.Lock()
        self._broadcast: dict[int, bool] = {}

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
        if served is not None and self.serves(served, self.version):
            return True
        if self.broadcast(self.version):
            # No files to load it from: the trainer's next broadcast (all the weights) brings it back.
            # (Said without suspecting it anew, which would wake the health monitor in a loop.)
            return False
        if self.version > 0:  # behind, or a broadcast broke midway: load the current version's files
            return server not in await self.load([server], self.version)
        if served is not None and served < 0:
            return False  # the first broadcast broke midway on it: the next one brings it back
        if served not in (None, 0):
            raise WeightSyncError(
                f"{server.root_url} serves the weights of step {served}, but this run has published none: "
                "it was loaded by another run; restart it so that it serves the base model"
            )
        return True

    def broadcast(self, step: int) -> bool:
        """Whether `step` reached the servers by the trainer's broadcast (its folder has no weights)."""
        if step not in self._broadcast:
            folder = step_dir(self.root, step)
            if not (folder / READY).exists():
                return False  # not published (yet): ask again later
            self._broadcast[step] = (folder / BROADCAST).exists()  # a published folder never changes
        return self._broadcast[step]

    def arriving(self, served: int) -> bool:
        """Whether `served` is newer than the current version and not published yet: a broadcast
        reaches the servers before the trainer writes its step's markers."""
        return served > self.version and not (step_dir(self.root, served) / READY).exists()

    def serves(self, served: int, step: int) -> bool:
        """Whether a server serving `served` may get work tagged with version `step`."""
        return served == step or (served > step and self.broadcast(served))

    async def load(self, servers: list[Server], step: int) -> list[Server]:
        """Make `servers` serve the weights of `step`; return those that could not be reached or,
        for a broadcast step, that do not serve it (now suspected, see `ServerPool.suspect`)."""
        path = str(step_dir(self.root, step).resolve())
        unreachable: list[Server] = []
        broadcast = self.broadcast(step)
        async with httpx.AsyncClient(timeout=self.timeout_s) as http:

            async def check(server: Server) -> None:
                served = await served_step(http, server)
                if served is None or not self.serves(served, step):
                    log.warning("%s did not receive the broadcast weights of step %d (it serves %s): no new "
                                "rollouts go to it until a later broadcast reaches it", server.root_url, step, served)  # fmt: skip
                    self.pool.suspect(server)
                    unreachable.append(server)

            async def load(server: Server) -> None:
                if broadcast:
                    return await check(server)
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
