"""The sampler of each inference server, one per base URL, made when first used.

Invariant: every model call to one server goes through that server's one `ServerSampler` (one
connection pool); vLLM's engine in this process (`ENGINE_URL`) is called directly, with no HTTP.
"""

from __future__ import annotations

from prime_rl.engine.local import ENGINE_URL
from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.envs.sampler import EngineSampler, ServerSampler


class Clients:
    """The sampler of each server the loop sends groups to; with `engine` (engine mode), vLLM's
    engine in this process is the one at `ENGINE_URL`."""

    def __init__(self, config: ClientConfig, model: str, engine=None):
        self.config = config
        self.model = model
        self.engine = engine
        self._samplers: dict = {}

    def get(self, base_url: str, model: str | None = None):
        key = (base_url, model or self.model)
        sampler = self._samplers.get(key)
        if sampler is None:
            if base_url == ENGINE_URL and self.engine is not None:
                sampler = EngineSampler(self.engine)
            else:  # servers, those that joined the pool included: HTTP
                sampler = ServerSampler(
                    base_url,
                    key[1],
                    self.config.timeout_s,
                    self.config.max_retries,
                )
            self._samplers[key] = sampler
        return sampler

    async def aclose(self) -> None:
        for sampler in self._samplers.values():
            await sampler.close()
        self._samplers.clear()
