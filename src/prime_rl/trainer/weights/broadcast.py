"""Trainer rank 0's side of `weight_broadcast.type = "collective"`: push one step's weights to every
inference server that answers, in memory.

Per update: ask each server how many workers it has (a server that does not answer is left out and
resynced by a later update, which always carries the full weights; the servers are those configured
and, with `follow_pool`, the run's pool members at that moment, so a server that joined the run takes
the next update and one that left is no longer waited for); tell each one, over HTTP, to join
a group of 1 + all workers under a fresh store prefix; broadcast the plan's chunks as rank 0; collect
the answers. Invariant: the result names exactly the servers that confirmed they serve the new
weights; anything else raises `BroadcastError`, and the caller writes the step's files instead.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from prime_rl.auth import clients
from prime_rl.auth.store import StoreServer
from prime_rl.engine.local import ENGINE_URL
from prime_rl.runtime import tls
from prime_rl.runtime.layout import pool_path
from prime_rl.trainer.config import WeightBroadcastConfig
from prime_rl.transport.weight_transfer import (
    DTYPES,
    chunk_bytes,
    join_group,
    make_plan,
    plan_to_json,
    seal_key,
    send,
)

log = logging.getLogger(__name__)


class BroadcastError(RuntimeError):
    """An update could not reach any server, or its group broke twice."""


class _GroupBroke(BroadcastError):
    """One attempt's group broke or no server confirmed it: worth one more attempt."""


@dataclass
class Pushed:
    servers: list[str]
    """The servers that confirmed they serve the new weights."""
    seconds: float
    bytes: int
    phases: dict[str, float]
    """Seconds per phase: asking the servers, forming the group, sending, the servers' answers."""


class Broadcaster:
    def __init__(self, config: WeightBroadcastConfig, output_dir: Path | None = None):
        self.config = config
        self.output_dir = output_dir
        """The run's folder: where the orchestrator says at which address its pool's members are
        listed (`follow_pool`)."""
        self.host = config.host or os.environ.get("MASTER_ADDR") or "127.0.0.1"
        self._store = None  # hosted for the whole run, from the first update on

    def members(self, http) -> list[str]:
        """The servers of this update: those configured, and, with `follow_pool`, every member of the
        run's pool now (a server that joined; one that left is no longer listed)."""
        urls = list(dict.fromkeys(url.rstrip("/") for url in self.config.servers))
        if not self.config.follow_pool or self.output_dir is None:
            return urls
        try:
            door = json.loads(pool_path(self.output_dir).read_text())["url"]
            listed = http.get(f"{door}/pool", timeout=5.0).json()["members"]
        except Exception:  # no pool (yet), or the orchestrator is restarting: those configured
            return urls
        for member in listed:
            if member["url"] == ENGINE_URL:  # vLLM's engine in the orchestrator: no server to reach
                continue
            url = str(member["url"]).removesuffix("/").removesuffix("/v1")
            if url not in urls and url.startswith(("http://", "https://")):
                urls.append(url)
        return urls

    def _ask(self, http, url: str) -> tuple[int, str | None] | None:
        """A server's workers and dtype, None if it does not answer."""
        try:
            reply = http.get(f"{url}/prime_rl/weights", timeout=5.0)
            if reply.status_code != 200:
                return None
            answer = reply.json()
            return int(answer.get("workers", 1)), answer.get("dtype")
        except Exception:
            return None

    def push(self, step: int, state: dict[str, torch.Tensor]) -> Pushed:
        """Push `state` as the weights of `step`, trying a second, fresh group once if the first broke.

        A group can fail to form for reasons of the moment (gloo's full mesh once lost a connection
        between two healthy servers on one host); a server whose receive failed still serves its
        previous weights, and every update carries all of them, so a retry is safe."""
        try:
            return self._push_once(step, state)
        except _GroupBroke as e:
            log.warning("%s; trying once more with a new group", e)
        try:
            return self._push_once(step, state)
        except _GroupBroke as e:
            raise BroadcastError(str(e)) from None

    def _invitation(self, step: int, prefix: str, plan, world: int, first_rank: int) -> dict:
        """What a server needs to join the update's group as ranks `first_rank`... and receive it."""
        c = self.config
        return {
            "step": step,
            "host": self.host,
            "port": c.port,
            "prefix": prefix,
            "first_rank": first_rank,
            "world_size": world,
            "plan": plan_to_json(plan),
            "timeout_s": c.timeout_s,
            "sealed": not torch.cuda.is_available() and seal_key(prefix) is not None,
        }

    def _invite(self, url: str, body: dict, answers: dict[str, str]) -> None:
        """Ask one server to receive the update (its own thread: it answers once it has the weights);
        its answer, 'ok' or why not, goes into `answers`. A refusal abandons the update: a server
        that will not join leaves the group unformed, and nobody waits `timeout_s` for it."""
        import httpx

        try:
            reply = httpx.post(
                f"{url}/prime_rl/receive_weights",
                json=body,
                timeout=3 * self.config.timeout_s + 30,
                verify=tls.context(),
                auth=clients.auth(),
            )
            answers[url] = (
                "ok" if reply.status_code == 200 else f"HTTP {reply.status_code}: {reply.text[:200]}"
            )
        except httpx.HTTPError as e:
            answers[url] = f"{type(e).__name__}: {e}"
        if answers[url] != "ok":
            self._store.table.abandon(body["prefix"], f"{url} answered {answers[url]}")

    def _send(self, prefix: str, world: int, state, plan, phases: dict[str, float]) -> Exception | None:
        """Join the update's group as rank 0 and send the chunks; the error, if a server went away
        mid-update or never joined (the servers' answers say which)."""
        try:
            cuda = torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
            t = time.perf_counter()
            group = join_group(self._store.store(), prefix, 0, world, self.config.timeout_s, cuda)
            phases["group"] = time.perf_counter() - t
            t = time.perf_counter()
            send(group, state, plan, device, None if cuda else seal_key(prefix))
            phases["send"] = time.perf_counter() - t
            del group
        except Exception as e:
            return e
        return None

    def _push_once(self, step: int, state: dict[str, torch.Tensor]) -> Pushed:
        import httpx

        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        c = self.config
        with httpx.Client(verify=tls.context(), auth=clients.auth()) as http:
            found = {url: self._ask(http, url) for url in self.members(http)}
        live = {url: a[0] for url, a in found.items() if a}
        if not live:
            raise BroadcastError(f"no inference server answered ({', '.join(found)})")
        # Weights travel in the servers' dtype (bf16 servers: half the bytes of fp32 master weights).
        dtypes = {a[1] for a in found.values() if a}
        cast = next(iter(dtypes)) if len(dtypes) == 1 and next(iter(dtypes)) in DTYPES else None
        if self._store is None:  # on the broadcast's interface only, for the run's processes only
            self._store = StoreServer(self.host, c.port, c.timeout_s)
        plan = make_plan(state, int(c.chunk_mb * 2**20), cast)
        world = 1 + sum(live.values())
        # Fresh per update, so that no key of an earlier group is read as this one's.
        prefix = f"prime_rl/step_{step}/{secrets.token_hex(8)}/"
        answers: dict[str, str] = {}
        phases["ask"] = time.perf_counter() - t0

        threads, rank = [], 1
        for url, n in live.items():
            body = self._invitation(step, prefix, plan, world, rank)
            threads.append(threading.Thread(target=self._invite, args=(url, body, answers), daemon=True))
            rank += n
        for t in threads:
            t.start()
        error = self._send(prefix, world, state, plan, phases)
        t = time.perf_counter()
        for thread in threads:
            thread.join()
        self._store.table.drop(prefix)
        phases["answers"] = time.perf_counter() - t
        confirmed = [url for url in live if answers.get(url) == "ok"]
        failed = {url: answers.get(url, "no answer") for url in live if url not in confirmed}
        if error is not None or not confirmed:
            raise _GroupBroke(
                f"the broadcast of step {step} failed ({type(error).__name__ + ': ' + str(error) if error else 'no server confirmed'}); "
                f"servers: {failed or confirmed}"
            )
        if failed:
            log.warning(
                "step %d: %s did not take the broadcast weights (%s); they are resynced by a later update",
                step,
                ", ".join(failed),
                "; ".join(failed.values()),
            )
        return Pushed(confirmed, time.perf_counter() - t0, sum(chunk_bytes(chunk) for chunk in plan), phases)
