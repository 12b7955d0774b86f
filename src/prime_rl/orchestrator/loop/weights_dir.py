"""Start-up check: every inference server accepts the folder this run's weights are published in.

A server loads weights only from under its weights dir (`<inference output_dir>/weights`), and LoRA
adapters only from under its adapters root (`inference.lora.runs_root`, by default that same dir).
The orchestrator asks it to load `<orchestrator output_dir>/weights/step_<N>`, where the trainer
publishes them. Invariant: the loop starts only when every server that says where it loads from
accepts that folder. A mismatch (the three processes started by hand with different output dirs)
is one line naming both settings, at start-up, instead of a refused reload after the first step.
A server that does not say (a plain vLLM server, an older prime_rl one) is not checked.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx

from prime_rl.auth import clients
from prime_rl.orchestrator.loop.servers import Server, ServerPool
from prime_rl.orchestrator.loop.weights import ADAPTERS_ROUTE, WEIGHTS_ROUTE, WeightSyncError
from prime_rl.runtime import secret, tls
from prime_rl.runtime.layout import weights_root


class WeightsDirMismatch(WeightSyncError):
    """A server would refuse to load this run's weights: the processes' output dirs disagree."""


class SecretRefused(WeightSyncError):
    """A server wants another run secret than this run's (or one, where this run has none)."""


async def check_weights_dirs(
    pool: ServerPool, output_dir: Path, adapter: bool, timeout_s: float = 30.0
) -> None:
    """Raise `WeightsDirMismatch` for the first server that would refuse `<output_dir>/weights`."""
    async with httpx.AsyncClient(timeout=timeout_s, verify=tls.context(), auth=clients.auth()) as http:
        roots = await asyncio.gather(*(_accepted_root(http, s, adapter) for s in pool.servers))
    for server, root in zip(pool.servers, roots, strict=True):
        refusal(server, root, output_dir, adapter)


async def check_weights_dir(server: Server, output_dir: Path, adapter: bool, timeout_s: float = 30.0) -> None:
    """`check_weights_dirs` for one server (one that joins the running run)."""
    async with httpx.AsyncClient(timeout=timeout_s, verify=tls.context(), auth=clients.auth()) as http:
        refusal(server, await _accepted_root(http, server, adapter), output_dir, adapter)


def refusal(server: Server, root: Path | None, output_dir: Path, adapter: bool) -> None:
    """Raise the one-line error of a server that loads from `root` (`_accepted_root`), if it would
    refuse this run's weights."""
    published = weights_root(output_dir).resolve()
    if root == UNAUTHORIZED:
        given = f"the secret in {secret.FILE_ENV}/{secret.ENV}" if secret.value() else "no secret"
        raise SecretRefused(
            f"the inference server at {server.root_url} refuses this run's requests (401: {given}): "
            f"give the orchestrator and the trainer the server's secret, {secret.FILE_ENV}=<its file>"
        )
    if root == NOT_OURS:
        raise SecretRefused(
            f"the inference server at {server.root_url} did not prove it holds this run's key (started "
            f"with another secret, or none, or another process has its port), so nothing was sent to it: "
            f"start it with the run's secret ({secret.FILE_ENV}=<output_dir>/{secret.FILE_NAME}), or, "
            f"for a shared server, use the tenant key its owner issued (PRIME_RL_TENANT_KEY_FILE)"
        )
    if root is None or published == root or root in published.parents:
        return
    what = "adapters" if adapter else "weights"
    setting = (
        "inference.lora.runs_root, by default <inference.output_dir>/weights"
        if adapter
        else "<inference.output_dir>/weights"
    )
    raise WeightsDirMismatch(
        f"orchestrator.output_dir = '{output_dir}': the trainer publishes this run's {what} in "
        f"{published}, but the inference server at {server.root_url} loads {what} only from under "
        f"{root} ({setting}): start `inference` with the same --output-dir as the orchestrator "
        "and the trainer"
    )


UNAUTHORIZED = Path("/401")
"""`_accepted_root`'s answer for a server that refused this run's secret."""
NOT_OURS = Path("/not-ours")
"""`_accepted_root`'s answer for a server that did not prove it holds this run's key."""


async def _accepted_root(http: httpx.AsyncClient, server: Server, adapter: bool) -> Path | None:
    """Where `server` loads weights (or adapters) from, None if it does not say. (A server without
    LoRA says None for adapters: claiming the adapter's name reports that, in its own words.)"""
    if server.engine is not None:
        return None  # the engine in this process loads any folder it is handed: nothing to check
    route, key = (ADAPTERS_ROUTE, "root") if adapter else (WEIGHTS_ROUTE, "weights_dir")
    try:
        resp = await http.get(f"{server.root_url}{route}")
        if resp.status_code == 401:
            return UNAUTHORIZED
    except clients.ServerNotOurs:
        return NOT_OURS
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    try:
        if resp.status_code != 200 or (adapter and not resp.json().get("enabled")):
            return None
        return Path(resp.json()[key])
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
