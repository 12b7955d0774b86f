"""Periodic evaluation on each eval env's eval dataset, beside training.

Invariant: an evaluation runs as a background task that shares the inference servers with training
and never holds up a training step; at most one evaluation runs at a time (a new one waits for the
previous to finish), and the last one is awaited before the orchestrator exits. An eval env whose
groups keep failing (`max_failed_groups` in a row) stops the run, as a training env does.
"""

from __future__ import annotations

import asyncio
import logging

from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs_config import EvalEnvConfig
from prime_rl.orchestrator.loop.failures import FailureStreak
from prime_rl.orchestrator.loop.scheduler import run_on
from prime_rl.orchestrator.loop.servers import ServerPool
from prime_rl.orchestrator.loop.weights import request_model
from prime_rl.orchestrator.messages import EnvSide, EnvView, Example, GroupJob
from prime_rl.orchestrator.rollout import Rollout
from prime_rl.runtime.monitor import MetricsLogger, stats

log = logging.getLogger("prime_rl.orchestrator")


class Evaluator:
    def __init__(
        self,
        config: OrchestratorConfig,
        envs: list[EnvView[EvalEnvConfig]],
        pool: ServerPool,
        env_side: EnvSide,
        metrics: MetricsLogger,
    ):
        self.config = config
        self.envs = envs
        self.pool = pool
        self.env_side = env_side
        self.metrics = metrics
        self._next_job_id = -1  # eval jobs count down, so that they never share an id with training's
        self._task: asyncio.Task | None = None
        # Evaluation uses at most half the in-flight budget, counted in examples of n rollouts.
        self._budget = max(1, config.max_inflight_rollouts // 2)
        self.streak = FailureStreak(config.max_failed_groups, config.client.health_timeout_s, what="eval env")

    def start(self, step: int, policy_version: int) -> None:
        previous = self._task
        self._task = asyncio.create_task(self._run(step, policy_version, previous), name=f"eval-{step}")

    async def finish(self) -> None:
        if self._task is not None:
            await self._task

    def raise_if_failed(self) -> None:
        """Raise what stopped the running evaluation (e.g. its rollouts kept failing), if anything."""
        task = self._task
        if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self, step: int, version: int, previous: asyncio.Task | None) -> None:
        if previous is not None:
            await previous
        metrics = {}
        for env in self.envs:
            rollouts = await self._evaluate(env, version)
            ok = [r for r in rollouts if not r.failed]
            name = env.name
            metrics.update(stats(f"eval/{name}/reward", [r.reward for r in ok]))
            metrics.update(stats(f"eval/{name}/completion_len", [float(r.num_completion_tokens) for r in ok]))
            metrics[f"eval/{name}/failed"] = len(rollouts) - len(ok)
            metrics[f"eval/{name}/rollouts"] = len(rollouts)
        metrics["eval/policy_version"] = version
        self.metrics.log(step, metrics, axis="eval/step")
        log.info(
            "eval at step %d | %s",
            step,
            " ".join(
                f"{e.name} reward {metrics.get(f'eval/{e.name}/reward/mean', float('nan')):.3f}"
                for e in self.envs
            ),
        )

    async def _evaluate(self, env: EnvView[EvalEnvConfig], version: int) -> list[Rollout]:
        n = env.config.rollouts_per_example
        limit = asyncio.Semaphore(max(1, self._budget // n))

        async def run(example: Example) -> list[Rollout]:
            try:
                while True:
                    server = await self.pool.pick_when_up()
                    job = GroupJob(
                        self._next_job_id,
                        env.name,
                        example.example_id,
                        example.task,
                        n,
                        version,
                        server.base_url,
                        eval=True,
                        model=request_model(self.config.model.name, self.config.lora_adapter, version),
                    )
                    self._next_job_id -= 1
                    rollouts = await run_on(self.env_side, self.pool, server, job)
                    if not (server.lost and all(r.failed for r in rollouts)):
                        break
                    # Its server died under it (and is being restarted): evaluated again, elsewhere
                    # or once it is back, so a restart costs the evaluation no example.
            finally:
                limit.release()
            self.streak.record(env.name, rollouts)
            return rollouts

        # The eval tasks are read as they are dispatched, not listed first.
        groups = []
        try:
            for example in env.examples:
                await limit.acquire()
                groups.append(asyncio.create_task(run(example)))
            results = await asyncio.gather(*groups)
        finally:
            for group in groups:
                group.cancel()
        return [r for rs in results for r in rs]
