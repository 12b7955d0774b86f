"""One group of an env through the loop's `run_on` and the in-process env side, against a server."""

import asyncio

from prime_rl.orchestrator.config import ClientConfig, OrchestratorConfig
from prime_rl.orchestrator.envs.local import LocalEnvs
from prime_rl.orchestrator.envs_config import EnvConfig
from prime_rl.orchestrator.loop.examples import ExampleSource
from prime_rl.orchestrator.loop.scheduler import run_on
from prime_rl.orchestrator.loop.servers import ServerPool
from prime_rl.orchestrator.messages import GroupJob


def run_group_on(env_id: str, base_url: str, size: int = 4, group_requests: bool = True):
    """(the group's rollouts, the pool's server it ran on) for the env's first example."""
    client = ClientConfig(base_urls=[base_url], timeout_s=10, group_requests=group_requests)
    config = OrchestratorConfig(envs=[EnvConfig(id=env_id, group_size=size)], client=client)
    envs, pool = LocalEnvs(config), ServerPool(client)

    async def go():
        (env,), _ = await envs.start()
        index, row = ExampleSource(env.dataset, 0).next_indexed()
        job = GroupJob(0, env.name, row["example_id"], index, size, 3, base_url)
        try:
            return await run_on(envs, pool, pool.servers[0], job), pool.servers[0]
        finally:
            await envs.close()

    return asyncio.run(go())
