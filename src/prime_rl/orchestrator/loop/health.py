"""Notice inference servers that die or restart, keep work off them, and bring them back.

A server is suspected when a whole group it served failed, when it did not answer a weight reload,
or when the periodic check finds it silent or serving other weights than the orchestrator's policy
version (it restarted from the base model). A suspected server gets no new rollouts (`up = False`)
and is polled with back-off until it answers; then, under the weight lock, it is loaded with the
current version and only after that marked up again. So rollouts are never tagged with a policy
version their server does not serve, and a restart costs only the rollouts that were on it (counted
as failed). A server silent for `silent_s` (hung: it accepts connections and answers nothing)
also loses its groups in flight at once (`on_silent`, the scheduler's `abandon`): they count as
failed, and their examples go to the next dispatch, instead of each request waiting out its timeout.
vLLM's engine in this process (engine mode) is a member like the others: when its engine core dies
(or `rl`'s watchdog kills it as hung) its groups in flight go to the next dispatch, and it is started
again, up to `client.max_restarts` times, then loaded with the current weights before it gets work.
Invariant: if no server has been up for `health_timeout_s`, the run stops with
`InferenceUnavailable` rather than waiting forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import httpx

from prime_rl.auth import clients
from prime_rl.orchestrator.loop.servers import InferenceUnavailable, Server, ServerPool
from prime_rl.orchestrator.loop.weights import UNKNOWN, WeightSync, WeightSyncError, served_step
from prime_rl.runtime import tls

log = logging.getLogger("prime_rl.orchestrator")

RESTART_ATTEMPTS = 3
"""Starts of vLLM's engine tried for one restart before the orchestrator gives up."""


class ServerHealth:
    def __init__(
        self,
        pool: ServerPool,
        weights: WeightSync,
        interval_s: float,
        give_up_s: float,
        request_timeout_s: float = 5.0,
        silent_s: float = 30.0,
        on_silent: Callable[[Server], int] | None = None,
        max_restarts: int = 0,
        on_restart: Callable[[int], None] | None = None,
    ):
        self.pool = pool
        self.weights = weights
        self.interval_s = interval_s
        self.give_up_s = give_up_s
        self.request_timeout_s = request_timeout_s
        self.silent_s = silent_s
        self.on_silent = on_silent
        self.max_restarts = max_restarts
        """Restarts of vLLM's engine in this process (engine mode) before a dead one stops the run."""
        self.engine_restarts = 0
        self.on_restart = on_restart
        """Told each engine restart's number (the run's restart record)."""
        self._recovering: dict[Server, asyncio.Task] = {}
        self._behind: set[Server] = set()
        """Servers waiting for a broadcast to catch up (said once, not at every check)."""
        self._none_up_since: float | None = None
        self.error: BaseException | None = None
        """Set when the monitor gave up; the step loop raises it."""

    def raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    async def run(self) -> None:
        try:
            await self._watch()
        except Exception as e:  # a bug here must stop the run, not silently end the watching
            self.error = e

    async def _watch(self) -> None:
        async with httpx.AsyncClient(
            timeout=self.request_timeout_s, verify=tls.context(), auth=clients.auth()
        ) as http:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.pool.suspected.wait(), self.interval_s)
                self.pool.suspected.clear()
                await asyncio.gather(*(self._check(http, s) for s in self.pool.servers))
                self._check_give_up()

    async def _check(self, http: httpx.AsyncClient, server: Server) -> None:
        if server in self._recovering:
            return
        if server.engine is not None and server.engine.stopped:
            if self.engine_restarts >= self.max_restarts:
                if self.error is None:
                    self.error = InferenceUnavailable(
                        f"vLLM's engine in this process stopped (its engine core or worker exited; see the log), "
                        f"and it was restarted {self.engine_restarts} time(s) of client.max_restarts = "
                        f"{self.max_restarts}: restart the orchestrator (`rl` does, up to deployment.max_restarts)"
                    )
                return
            server.up = False
            self._recovering[server] = asyncio.create_task(self._restart_engine(server))
            return
        if server.up:
            version = self.weights.version
            step = await served_step(http, server, self.weights.adapter)
            if step is not None and step >= 0:
                server.step = step
            if step is not None and (step == UNKNOWN or self.weights.serves(step, self.weights.version)):
                return
            if step is not None and (self.weights.lock.locked() or self.weights.version != version):
                return  # a reload was under way: look again next time
            if step is not None and self.weights.arriving(step):
                return  # a broadcast reached it before the trainer wrote the step's marker: likewise
            server.up = False
        self._recovering[server] = asyncio.create_task(self._recover(http, server))

    async def _recover(self, http: httpx.AsyncClient, server: Server) -> None:
        # Suspected servers that answer at once and serve the current weights (a group failed for
        # another reason) go back to work silently; anything else is logged.
        delay, t0, noted, abandoned = 0.25, time.monotonic(), False, False
        try:
            while (step := await served_step(http, server, self.weights.adapter)) is None:
                if server.left:
                    return
                if not noted:
                    log.warning(
                        "inference server %s does not answer: no new rollouts go to it until it is back",
                        server.root_url,
                    )
                    noted = True
                if not abandoned and self.on_silent and time.monotonic() - t0 >= self.silent_s:
                    abandoned = True
                    n = self.on_silent(server)
                    log.warning(
                        "inference server %s has not answered for %.0f s: its %d group(s) in flight "
                        "failed, their examples go to the next dispatch%s",
                        server.root_url,
                        time.monotonic() - t0,
                        n,
                        "; it leaves the pool (it joined: it comes back by registering again)"
                        if server.joined
                        else "",
                    )
                    if server.joined:  # (a restarted one may register at another address)
                        self.pool.remove(server)
                        return
                await asyncio.sleep(delay)
                delay = min(2 * delay, 5.0)
            async with self.weights.lock:
                version = self.weights.version
                if step != UNKNOWN and not self.weights.serves(step, version) and not server.joining:
                    if not self.weights.broadcast(version):
                        log.warning(
                            "inference server %s serves step %d, not %d: reloading it before it gets work",
                            server.root_url,
                            step,
                            version,
                        )
                    elif server not in self._behind:
                        log.warning(
                            "inference server %s serves step %d, not %d: it gets work again once a weight "
                            "broadcast reaches it",
                            server.root_url,
                            step,
                            version,
                        )
                        self._behind.add(server)
                    noted = True
                # If it went away again, the load has suspected it anew and the next check retries.
                loaded = await self.weights.restore(server, None if step == UNKNOWN else step)
                server.up = loaded and not server.left
                if server.up:
                    server.step = self.weights.version
            if server.up:
                self._behind.discard(server)
            if server.up and server.joining:
                server.joining = False
                log.info(
                    "inference server %s joined the pool after %.1f s, serving step %d",
                    server.root_url,
                    time.monotonic() - t0,
                    self.weights.version,
                )
            elif server.up and noted:
                log.info(
                    "inference server %s is back after %.1f s, serving step %d",
                    server.root_url,
                    time.monotonic() - t0,
                    self.weights.version,
                )
        except WeightSyncError as e:
            if not server.joining:  # a member of the run refused a reload: nothing more to do here
                self.error = e
                return
            # A server that joined but will not serve this run's weights is no member: the run goes on.
            log.warning("inference server %s cannot join the pool: %s", server.root_url, e)
            self.pool.remove(server)
        except Exception as e:  # a bug here must stop the run, not silently end the recovery
            self.error = e
        finally:
            del self._recovering[server]

    async def _restart_engine(self, server: Server) -> None:
        """vLLM's engine in this process died (its core exited, or `rl`'s watchdog killed it as
        hung): its groups in flight go to the next dispatch, it starts again and, loaded with the
        current weights, gets work again."""
        t0 = time.monotonic()
        self.engine_restarts += 1
        try:
            if self.on_silent:
                self.on_silent(server)
            log.warning(
                "vLLM's engine core in this process died: restarting the engine (%d of %d, "
                "client.max_restarts); the groups that were on it go to the next dispatch",
                self.engine_restarts,
                self.max_restarts,
            )
            try:  # the run's restart record (`restarts.jsonl`, in the step's metrics)
                if self.on_restart:
                    self.on_restart(self.engine_restarts)
            except OSError as e:  # a full disk loses the line, not the restart
                log.warning("cannot record the engine's restart: %s", e)
            for attempt in range(1, RESTART_ATTEMPTS + 1):
                try:
                    await server.engine.restart()
                    break
                except Exception as e:  # (seen once: vLLM's start-up handshake failing at once)
                    if attempt == RESTART_ATTEMPTS:
                        raise
                    log.info("vLLM's engine did not start (%s: %s); trying again", type(e).__name__, e)
                    await asyncio.sleep(attempt)
            async with self.weights.lock:
                server.up = await self.weights.restore(server, 0)
            log.info(
                "vLLM's engine is back after %.1f s, serving step %d",
                time.monotonic() - t0,
                self.weights.version,
            )
        except Exception as e:  # a restart that fails: the orchestrator stops (and `rl` restarts it)
            log.error("vLLM's engine in this process could not restart: %s: %s", type(e).__name__, e)
            self.error = InferenceUnavailable(
                f"vLLM's engine in this process could not restart: {type(e).__name__}: {e}"
            )
        finally:
            del self._recovering[server]

    def _check_give_up(self) -> None:
        if any(s.up for s in self.pool.servers):
            self._none_up_since = None
            return
        now = time.monotonic()
        self._none_up_since = self._none_up_since or now
        if now - self._none_up_since > self.give_up_s and self.error is None:
            self.error = InferenceUnavailable(
                f"no inference server answered for {self.give_up_s:.0f} s "
                f"({', '.join(s.root_url for s in self.pool.servers)}); "
                "restart `uv run inference` there, or raise client.health_timeout_s to wait longer"
            )
