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

With a LoRA adapter (`orchestrator.lora_adapter`) the steps are the adapter's: a step folder holds
the adapter, servers load it under the run's adapter name (claimed for this run's output dir before
the first step, so two runs never share a name), and requests name the adapter from version 1 on.
Version 0 is the base model, which the untrained adapter (B = 0) equals; a server that does not hold
the adapter serves version 0 of this run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

import httpx

from prime_rl.auth import clients, signing
from prime_rl.engine.local import EngineBroken, EngineStopped
from prime_rl.orchestrator.loop.servers import Server, ServerPool
from prime_rl.runtime import activity, secret, tls
from prime_rl.runtime.layout import BROADCAST, READY, latest_ready_step, step_dir

log = logging.getLogger(__name__)

LOAD_ROUTE = "/prime_rl/load_weights"
WEIGHTS_ROUTE = "/prime_rl/weights"
LOAD_ADAPTER_ROUTE = "/prime_rl/load_adapter"
UNLOAD_ADAPTER_ROUTE = "/prime_rl/unload_adapter"
ADAPTERS_ROUTE = "/prime_rl/adapters"
UNKNOWN = -1
"""Served step of a server that is healthy but has no weights route (a plain vLLM server)."""


@dataclass(frozen=True)
class Adapter:
    """This run's LoRA adapter on the servers."""

    name: str
    owner: str
    """The run's owner token (`secret.owner_token`): who holds the name on a server."""


def request_model(base: str, adapter: str | None, version: int) -> str:
    """The model name requests of `version` ask for: the run's adapter once the trainer published
    one, the base model before (an untrained adapter changes nothing)."""
    return adapter if adapter is not None and version > 0 else base


async def served_step(http: httpx.AsyncClient, server: Server, adapter: Adapter | None = None) -> int | None:
    """The step of the weights (or of this run's adapter) `server` serves, UNKNOWN if it cannot say,
    None if it does not answer."""
    if server.engine is not None:
        return server.engine.served_step
    try:
        if adapter is not None:
            resp = await http.get(
                f"{server.root_url}{ADAPTERS_ROUTE}", headers={secret.OWNER_HEADER: adapter.owner}
            )
        else:
            resp = await http.get(f"{server.root_url}{WEIGHTS_ROUTE}")
        if resp.status_code == 200 and adapter is not None:
            held = resp.json()["adapters"].get(adapter.name)  # only this run's adapters are listed
            return int(held["step"]) if held is not None else 0
        if resp.status_code == 200:
            return int(resp.json()["step"])
        if resp.status_code == 404 and (await http.get(f"{server.root_url}/health")).status_code == 200:
            return UNKNOWN
    except (httpx.HTTPError, ValueError, KeyError):
        pass
    return None


class WeightSyncError(RuntimeError):
    """An inference server could not load published weights."""


class AdapterRefused(WeightSyncError):
    """A server will not serve this run's adapter: started without LoRA, or the name is taken."""


class WeightSync:
    def __init__(
        self,
        root: Path,
        pool: ServerPool,
        version: int = 0,
        timeout_s: float = 300.0,
        adapter: Adapter | None = None,
    ):
        self.root = Path(root)
        self.pool = pool
        self.version = version
        self.timeout_s = timeout_s
        self.adapter = adapter
        self.lock = asyncio.Lock()
        self._broadcast: dict[int, bool] = {}

    async def claim(self) -> None:
        """Claim the adapter's name on every server before the first request (no-op without one)."""
        if self.adapter is None:
            return
        async with httpx.AsyncClient(
            timeout=self.timeout_s, verify=tls.context(), auth=clients.auth()
        ) as http:
            await asyncio.gather(*(self._claim(http, s) for s in self.pool.servers))

    async def _claim(self, http: httpx.AsyncClient, server: Server) -> None:
        body = {"name": self.adapter.name, "owner": self.adapter.owner}
        resp = await http.post(f"{server.root_url}{LOAD_ADAPTER_ROUTE}", json=body)
        if resp.status_code == 404:
            raise AdapterRefused(
                f"orchestrator.lora_adapter = '{self.adapter.name}': {server.root_url} has no adapter routes; "
                "serve the model with `uv run inference` and [inference.lora]"
            )
        if resp.status_code != 200:
            raise AdapterRefused(
                f"orchestrator.lora_adapter = '{self.adapter.name}': {server.root_url} refused it: {_error(resp)}"
            )

    async def release(self) -> None:
        """Give the adapter's name back on every server that answers (a run that ended)."""
        if self.adapter is None:
            return
        body = {"name": self.adapter.name, "owner": self.adapter.owner}
        async with httpx.AsyncClient(timeout=10.0, verify=tls.context(), auth=clients.auth()) as http:
            for server in self.pool.servers:
                with contextlib.suppress(httpx.HTTPError):  # a server that is gone holds nothing
                    await http.post(f"{server.root_url}{UNLOAD_ADAPTER_ROUTE}", json=body)

    async def poll(self) -> int:
        """Load the newest published weights if they are newer than what is served; return the version."""
        newest = await asyncio.to_thread(latest_ready_step, self.root)
        if newest is not None and newest > self.version:
            async with self.lock:
                if newest > self.version:
                    await self.load([s for s in self.pool.servers if s.up], newest)
                    self.version = newest
                    if not all(s.up for s in self.pool.servers):
                        # A server waiting for a broadcast (one that joined, or came back) may hold
                        # these weights now: look at once, not at the next periodic check.
                        self.pool.suspected.set()
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
        if served is not None and (self.serves(served, self.version) or self.arriving(served)):
            return True  # (arriving: the next broadcast reached it before the trainer's marker)
        if self.broadcast(self.version):
            # No files to load it from: the trainer's next broadcast (all the weights) brings it back.
            # (Said without suspecting it anew, which would wake the health monitor in a loop.)
            return False
        if self.version > 0:  # behind, ahead, or a broadcast broke midway: load the current version's files
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
        for a broadcast step, that do not serve it (now suspected, see `ServerPool.suspect`). A
        server serving a newer step goes back to `step` (`rewind`): this run's version is the
        orchestrator's to set (a trainer restarted from an older checkpoint publishes older steps
        again)."""
        path = str(step_dir(self.root, step).resolve())
        activity.doing(f"loading the weights of step {step} into {len(servers)} server(s)", "inference")
        unreachable: list[Server] = []
        broadcast = self.broadcast(step)
        # Signed as the orchestrator: the one caller whose `rewind` a server takes.
        async with httpx.AsyncClient(
            timeout=self.timeout_s, verify=tls.context(), auth=clients.auth(signing.ORCHESTRATOR)
        ) as http:

            async def check(server: Server) -> None:
                served = await served_step(http, server, self.adapter)
                if served is None or not self.serves(served, step):
                    log.warning(
                        "%s did not receive the broadcast weights of step %d (it serves %s): no new "
                        "rollouts go to it until a later broadcast reaches it",
                        server.root_url,
                        step,
                        served,
                    )
                    self.pool.suspect(server)
                    unreachable.append(server)

            async def load(server: Server) -> None:
                if broadcast:
                    return await check(server)
                if server.engine is not None:
                    try:
                        await server.engine.load_weights(Path(path), step)
                    except EngineStopped as e:  # the health monitor restarts it, then loads it
                        log.warning("vLLM's engine in this process did not load step %d: %s", step, e)
                        self.pool.suspect(server)
                        unreachable.append(server)
                    except EngineBroken as e:
                        raise WeightSyncError(
                            f"the engine in this process could not load step {step}: {e}"
                        ) from e
                    return
                if self.adapter is not None:
                    route = LOAD_ADAPTER_ROUTE
                    body = {
                        "name": self.adapter.name,
                        "owner": self.adapter.owner,
                        "path": path,
                        "step": step,
                    }
                else:
                    route, body = LOAD_ROUTE, {"path": path, "step": step, "rewind": True}
                try:
                    resp = await http.post(f"{server.root_url}{route}", json=body)
                except httpx.HTTPError as e:
                    log.warning(
                        "%s did not answer the weight reload of step %d: %r", server.root_url, step, e
                    )
                    self.pool.suspect(server)
                    unreachable.append(server)
                    return
                if resp.status_code != 200 and server.lost:
                    # It left the pool (or is leaving) while the reload was in flight: its vLLM may
                    # be shutting down under the request. A departure, not a refusal.
                    log.info(
                        "%s left the pool during the weight reload of step %d (%d)",
                        server.root_url,
                        step,
                        resp.status_code,
                    )
                    unreachable.append(server)
                elif resp.status_code != 200:
                    what = f"the adapter '{self.adapter.name}'" if self.adapter else "the weights"
                    raise WeightSyncError(
                        f"{server.root_url} refused to load {what} of step {step} ({resp.status_code}): {_error(resp)}"
                    )

            await asyncio.gather(*(load(s) for s in servers))
        for server in servers:
            if server not in unreachable:
                server.step = step
        return unreachable


def _error(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"])
    except (ValueError, KeyError, TypeError):
        return resp.text[:300]
