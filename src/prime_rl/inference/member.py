"""A server that joins a running run's inference pool, and leaves it when it is stopped.

`uv run inference --pool.join <run output dir or pool address>`: once its vLLM answers /health, the
server registers with the run's orchestrator (`orchestrator/loop/registry.py`), which loads the
run's current weights on it before it gets groups. On SIGTERM (SLURM and Kubernetes send it before
they stop a job) or Ctrl-C it asks to leave: the orchestrator sends it no new group, waits up to
`pool.drain_s` for those in flight and hands back the rest; then vLLM stops and the process exits 0.
A member registers again with an orchestrator that restarted, and one that joined by the run's
folder stops, status 0, once the run is over.

Invariants: every request carries the run secret; a refusal (another secret, another output dir) is
one line here, with the orchestrator's reason, one line in the orchestrator's log, and the server
stops with status 2, since a restart would be refused again. An orchestrator that cannot be reached
is tried again with back-off until `pool.join_timeout_s` (it may be restarting).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

from prime_rl.auth import clients
from prime_rl.engine.server import is_healthy
from prime_rl.inference.config import InferenceConfig
from prime_rl.runtime import secret, tls
from prime_rl.runtime.layout import pool_path

NEEDS_USER = 2
MEMBER_POLL_S = 5.0
"""How often a member looks whether its orchestrator still knows it, and whether the run is over."""


class JoinRefused(RuntimeError):
    """The orchestrator will not take this server (another run secret, another output dir)."""


def own_url(config: InferenceConfig) -> str:
    """Where the orchestrator reaches this server."""
    if config.pool.url:
        return config.pool.url.rstrip("/").removesuffix("/v1")
    host = config.server.host
    if host in ("0.0.0.0", "::"):
        host = socket.gethostname()
    return f"http://{host}:{config.server.port}"


def door(join: str) -> str:
    """The pool's address from `pool.join`: an address as is, or the one a run folder holds."""
    if join.startswith(("http://", "https://")):
        return join.rstrip("/")
    path = pool_path(Path(join))
    try:
        return str(json.loads(path.read_text())["url"]).rstrip("/")
    except (OSError, ValueError, KeyError) as e:
        raise FileNotFoundError(
            f"pool.join = '{join}': no pool address in {path} ({type(e).__name__}); is the run's "
            "orchestrator running with orchestrator.pool.enabled?"
        ) from None


class Member:
    """This server's membership: `join` once its vLLM is healthy (in a thread), `leave` when stopped."""

    def __init__(self, config: InferenceConfig):
        self.config = config
        self.url = own_url(config)
        self.joined = threading.Event()
        self.refused: str | None = None
        """The orchestrator's reason, when it refused this server."""
        self.left = False
        """Whether the run let it go (its groups drained or handed back)."""
        self.run_over = False
        """Whether the run it joined is over (the server then stops, status 0)."""

    def _post(self, route: str, body: dict, timeout_s: float) -> httpx.Response:
        address = door(self.config.pool.join)
        return httpx.post(
            f"{address}{route}", json=body, timeout=timeout_s, auth=clients.auth(), verify=tls.context()
        )

    def join(self, stopping: threading.Event) -> None:
        """Wait until this server is healthy, then register, trying again while the orchestrator
        cannot be reached. Sets `refused` (and says it) when the orchestrator refuses."""
        p = self.config.pool
        deadline = time.monotonic() + p.join_timeout_s
        delay, last = 0.5, "no answer"
        while not stopping.is_set() and time.monotonic() < deadline:
            if is_healthy(self.url):
                try:
                    resp = self._post("/pool/join", {"url": self.url}, 30.0)
                except clients.ServerNotOurs:
                    # The pool holds another key: another run's secret, or a process on its port.
                    # Nothing was sent to it; asking again would not change its answer.
                    self.refused = (
                        f"the run's pool at {door(p.join)} did not prove it holds this server's secret "
                        f"(the run has another; start the server with the run's, "
                        f"{secret.FILE_ENV}=<output_dir>/{secret.FILE_NAME})"
                    )
                    print(f"inference: error: {self.refused}", file=sys.stderr, flush=True)
                    return
                except (httpx.HTTPError, FileNotFoundError) as e:
                    last = str(e) or type(e).__name__
                else:
                    if resp.status_code == 200:
                        print(
                            f"inference: joined the run's pool at {door(p.join)} as {self.url} (the run is at "
                            f"step {resp.json().get('step')}); it loads the run's weights, then sends groups",
                            file=sys.stderr,
                            flush=True,
                        )
                        self.joined.set()
                        self._stay_member(stopping)
                        return
                    self.refused = _reason(resp)
                    print(
                        f"inference: error: the run's orchestrator at {door(p.join)} refused this server: "
                        f"{self.refused}",
                        file=sys.stderr,
                        flush=True,
                    )
                    return
            stopping.wait(delay)
            delay = min(2 * delay, 5.0)
        if not stopping.is_set():
            self.refused = f"its pool could not be reached within pool.join_timeout_s ({last})"
            print(f"inference: error: {self.refused}", file=sys.stderr, flush=True)

    def _stay_member(self, stopping: threading.Event) -> None:
        """While serving: register again with an orchestrator that restarted (it forgets who joined),
        and stop once the run is over (a member that joined by the run's folder reads it there:
        a server left behind would hold its machine for nothing)."""
        join = self.config.pool.join
        by_folder = not join.startswith(("http://", "https://"))
        while not stopping.wait(MEMBER_POLL_S):
            if by_folder:
                try:
                    if json.loads(pool_path(Path(join)).read_text()).get("finished", False):
                        print(
                            "inference: the run this server joined is over; stopping",
                            file=sys.stderr,
                            flush=True,
                        )
                        self.run_over = True
                        return
                except (OSError, ValueError):
                    pass
            try:
                address = door(join)
                members = httpx.get(
                    f"{address}/pool", timeout=10.0, auth=clients.auth(), verify=tls.context()
                ).json()["members"]
                if not any(m["url"].removesuffix("/v1") == self.url for m in members):
                    resp = self._post("/pool/join", {"url": self.url}, 30.0)
                    if resp.status_code == 200:
                        print(
                            f"inference: joined the run's pool again at {address}",
                            file=sys.stderr,
                            flush=True,
                        )
            except (httpx.HTTPError, FileNotFoundError, ValueError, KeyError, TypeError):
                pass  # the orchestrator is restarting, or gone: look again later

    def leave(self) -> bool:
        """Ask to leave and wait for the drain (at most `pool.drain_s` there); whether it was granted."""
        if not self.joined.is_set():
            return False
        drain_s = self.config.pool.drain_s
        print(
            f"inference: leaving the run's pool: groups in flight here have {drain_s:.0f} s to finish",
            file=sys.stderr,
            flush=True,
        )
        try:
            resp = self._post("/pool/leave", {"url": self.url, "drain_s": drain_s}, drain_s + 30.0)
        except (httpx.HTTPError, FileNotFoundError) as e:
            print(
                f"inference: the run's orchestrator did not answer the leave ({e}); stopping", file=sys.stderr
            )
            return False
        if resp.status_code != 200:
            print(f"inference: the run's orchestrator refused the leave: {_reason(resp)}", file=sys.stderr)
            return False
        body = resp.json()
        self.left = True
        print(
            f"inference: left the run's pool after {body.get('seconds', 0):.1f} s "
            f"({body.get('handed_back', 0)} group(s) handed back)",
            file=sys.stderr,
            flush=True,
        )
        return True


def _reason(resp: httpx.Response) -> str:
    try:
        return str(resp.json()["error"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {resp.status_code}"
