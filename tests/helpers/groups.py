"""One group of an env against a server: through the env side's group runner (`run_group`), or
through the loop's `run_on` and the in-process env side (`run_group_on`)."""

import asyncio

from fake_server import MODEL
from prime_rl.orchestrator.config import ClientConfig, OrchestratorConfig
from prime_rl.orchestrator.envs.client import Clients
from prime_rl.orchestrator.envs.group_runner import GroupRun, run_group
from prime_rl.orchestrator.envs.load import load_env
from prime_rl.orchestrator.envs.local import LocalEnvs
from prime_rl.orchestrator.envs.renderer import Renderer
from prime_rl.orchestrator.envs.rewards import RewardRunner
from prime_rl.orchestrator.envs_config import EnvConfig, RewardsConfig, SamplingConfig
from prime_rl.orchestrator.loop.examples import ExampleSource
from prime_rl.orchestrator.loop.scheduler import run_on
from prime_rl.orchestrator.loop.servers import ServerPool
from prime_rl.orchestrator.messages import GroupJob


def run_groups(
    base_url: str,
    env_id: str,
    args: dict | None = None,
    size: int = 4,
    groups: int = 1,
    runner: RewardRunner | None = None,
    timeout_s: float = 30,
    sampling: SamplingConfig | None = None,
    state_columns: tuple[str, ...] = (),
    model: str = MODEL,
    served: str = "m",
    merge: bool = True,
    on_loop=None,
):
    """(env, tasks, rollouts) of `groups` groups of `size` rollouts of the env at once, each at policy
    version 2, run by `run_group` against the server at `base_url` (serving `served`); `merge`: a
    group's identical first turns as one request; `on_loop` is called on the event loop first."""
    runner = runner or RewardRunner(RewardsConfig())
    env = load_env(EnvConfig(id=env_id, args=args or {}, group_size=size), rewards=runner)
    examples = ExampleSource(env.examples, 0)
    picked = [examples.next() for _ in range(groups)]
    tasks = [env.vf_env.task(e.task) for e in picked]
    sampling = sampling or SamplingConfig(max_tokens=16)
    jobs = [
        GroupRun(env.name, env.vf_env, task, e.example_id, size, 2, sampling, state_columns, merge)
        for e, task in zip(picked, tasks, strict=True)
    ]
    renderer = Renderer.for_model(model)

    async def go():
        clients = Clients(ClientConfig(base_urls=[base_url], timeout_s=timeout_s), served)
        sampler = clients.get(base_url)
        if on_loop is not None:
            on_loop()
        try:
            out = await asyncio.gather(
                *(run_group(job, sampler, renderer, served, timeout_s) for job in jobs)
            )
        finally:
            await clients.aclose()
        return [r for group in out for r in group]

    return env, tasks, asyncio.run(go())


def run_group_on(env_id: str, base_url: str, size: int = 4, group_requests: bool = True):
    """(the group's rollouts, the pool's server it ran on) for the env's first example."""
    client = ClientConfig(base_urls=[base_url], timeout_s=10, group_requests=group_requests)
    config = OrchestratorConfig(
        model={"name": MODEL}, envs=[EnvConfig(id=env_id, group_size=size)], client=client
    )
    envs, pool = LocalEnvs(config), ServerPool(client)

    async def go():
        (env,), _ = await envs.start()
        example = ExampleSource(env.examples, 0).next()
        job = GroupJob(0, env.name, example.example_id, example.task, size, 3, base_url)
        try:
            return await run_on(envs, pool, pool.servers[0], job), pool.servers[0]
        finally:
            await envs.close()

    return asyncio.run(go())
