"""Follow the trainer's published weights and make the inference servers serve the newest.

The trainer publishes the weights after step N as `<output_dir>/weights/step_<N>/`, and writes the
`READY` marker in it last. Invariant: the orchestrator's policy version only advances once every
inference server has confirmed that it serves those weights.
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx

from prime_rl.orchestrator.client import ServerPool

READY = "READY"
LOAD_ROUTE = "/prime_rl/load_weights"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def weights_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "weights"


def latest_ready_step(root: Path) -> int | None:
    """The highest N with `step_<N>/READY` under root, or None."""
    best = None
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return None
    for entry in entries:
        m = _STEP_DIR.match(entry.name)
        if m and (entry / READY).exists():
            n = int(m.group(1))
            best = n if best is None or n > best else best
    return best


class WeightSyncError(RuntimeError):
    """An inference server could not load published weights."""


class WeightSync:
    def __init__(self, root: Path, pool: ServerPool, version: int = 0, timeout_s: float = 300.0):
        self.root = Path(root)
        self.pool = pool
        self.version = version
        self.timeout_s = timeout_s
        self.reload_s = 0.0
        """Seconds spent in weight reloads since the orchestrator last read and reset it."""

    async def poll(self) -> int:
        """Load the newest published weights if they are newer than what is served; return the version."""
        newest = await asyncio.to_thread(latest_ready_step, self.root)
        if newest is not None and newest > self.version:
            t0 = time.perf_counter()
            await self._load(newest)
            self.reload_s += time.perf_counter() - t0
            self.version = newest
        return self.version

    async def _load(self, step: int) -> None:
        path = str((self.root / f"step_{step}").resolve())
        async with httpx.AsyncClient(timeout=self.timeout_s) as http:

            async def load(root_url: str) -> None:
                try:
                    resp = await http.post(f"{root_url}{LOAD_ROUTE}", json={"path": path, "step": step})
                except httpx.HTTPError as e:
                    raise WeightSyncError(
                        f"{root_url} did not answer the weight reload of step {step}: {e}"
                    ) from None
                if resp.status_code != 200:
                    raise WeightSyncError(
                        f"{root_url} refused to load the weights of step {step} ({resp.status_code}): {resp.text[:300]}"
                    )

            await asyncio.gather(*(load(s.root_url) for s in self.pool.servers))
