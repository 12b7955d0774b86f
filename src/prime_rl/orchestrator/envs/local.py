"""The env side in one process: the envs, their reward runner and reward models, the teacher and the
inference clients, behind the `EnvSide` contract of `messages.py`.

The orchestrator uses it directly when `env_workers = 0`; each env worker (`worker.py`) runs one.
Invariant: `run` answers a job with exactly `job.size` rollouts (teacher-scored for training jobs
when a teacher is configured) and raises only when cancelled; `close` runs every env's teardown.
"""

from __future__ import annotations

import logging

from prime_rl.engine.local import LocalEngine
from prime_rl.environments import EnvError
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs.client import Clients
from prime_rl.orchestrator.envs.group_runner import GroupRun, run_group
from prime_rl.orchestrator.envs.load import LoadedEnv, load_env, load_eval_env
from prime_rl.orchestrator.envs.renderer import Renderer
from prime_rl.orchestrator.envs.reward_model import RewardModelError, RewardModels
from prime_rl.orchestrator.envs.rewards import RewardRunner
from prime_rl.orchestrator.envs.teacher import Teacher, TeacherError
from prime_rl.orchestrator.envs_config import EnvConfig, EvalEnvConfig
from prime_rl.orchestrator.messages import EnvView, GroupJob
from prime_rl.orchestrator.rollout import Rollout, failed_rollout
from prime_rl.runtime.logging_setup import adopt_verifiers_logging

log = logging.getLogger("prime_rl.orchestrator")


class LocalEnvs:
    """Loads the configured envs; with `rollouts`, also runs groups on them (else it only serves
    their task streams to the loop, while env workers run the groups); with `engine`, on vLLM's engine
    in this process (started by the loop before the first group)."""

    def __init__(self, config: OrchestratorConfig, rollouts: bool = True, engine: LocalEngine | None = None):
        self.config = config
        self.rollouts = rollouts
        self.train: dict[str, LoadedEnv[EnvConfig]] = {}
        self.evals: dict[str, LoadedEnv[EvalEnvConfig]] = {}
        self.rewards: RewardRunner | None = None
        self.reward_models: RewardModels | None = None
        self.teacher: Teacher | None = None
        self.renderer: Renderer | None = None
        self.clients = Clients(config.client, config.model.name, engine)

    def load(self) -> tuple[list[EnvView[EnvConfig]], list[EnvView[EvalEnvConfig]]]:
        """Load the envs (blocking: imports, first tasks); what the loop needs of them."""
        c = self.config
        if self.rollouts:
            self.rewards = RewardRunner(c.rewards)
            self.reward_models = RewardModels()
            try:  # the policy's chat template renders every turn: a model without one cannot play
                self.renderer = Renderer.for_model(c.model.name)
            except Exception as e:
                raise EnvError(
                    f"model.name = {c.model.name!r}: its tokenizer (the chat template every turn is "
                    f"rendered with) cannot be loaded: {type(e).__name__}: {e}"
                ) from None
        for i, e in enumerate(c.envs):
            env = load_env(e, self.rewards, self.reward_models, f"envs[{i}]", score=self.rollouts)
            self.train[env.name] = env
        for e in c.eval.envs:
            env = load_eval_env(e, self.rewards)
            self.evals[env.name] = env
        adopt_verifiers_logging()
        return [e.view() for e in self.train.values()], [e.view() for e in self.evals.values()]

    async def start(self) -> tuple[list[EnvView[EnvConfig]], list[EnvView[EvalEnvConfig]]]:
        c = self.config
        envs = self.load()
        if self.rollouts:
            try:
                await self.reward_models.check()
            except RewardModelError as e:
                raise EnvError(str(e)) from None
            if c.teacher:
                self.teacher = Teacher(c.teacher)
                log.info("checking the teacher at %s", c.teacher.base_url)
                try:
                    await self.teacher.check(wait_s=c.client.health_timeout_s)
                except TeacherError as e:
                    raise EnvError(str(e)) from None
        return envs

    async def run(self, job: GroupJob) -> list[Rollout]:
        if job.eval:
            env = self.evals[job.env_name]
            columns: tuple[str, ...] = ()
        else:
            env = self.train[job.env_name]
            columns = tuple(env.config.state_columns)
        try:
            task = env.vf_env.task(job.task)
        except Exception as e:  # data that does not fit the taskset's task type (another version?)
            reason = (
                f"EnvError: env '{job.env_name}': example {job.example_id!r} is not one of its tasks: {e}"
            )
            return [
                failed_rollout(job.env_name, job.example_id, job.policy_version, reason)
                for _ in range(job.size)
            ]
        c = self.config
        run = GroupRun(
            job.env_name,
            env.vf_env,
            task,
            job.example_id,
            job.size,
            job.policy_version,
            env.config.sampling,
            columns,
            c.client.group_requests,
        )
        model = job.model or c.model.name
        try:
            sampler = self.clients.get(job.base_url, model)
            rollouts = await run_group(run, sampler, self.renderer, model, c.client.timeout_s)
            if self.teacher and not job.eval:
                rollouts = await self.teacher.score_group(rollouts)
        except Exception as e:  # never expected (both fail rollouts instead), but never a lost job
            reason = f"{type(e).__name__}: {e}"
            return [
                failed_rollout(job.env_name, job.example_id, job.policy_version, reason)
                for _ in range(job.size)
            ]
        return rollouts

    async def close(self) -> None:
        for env in [*self.train.values(), *self.evals.values()]:
            try:
                await env.vf_env.close()
            except Exception as e:
                log.warning("teardown of env %s failed: %s", env.name, e)
        if self.rewards:
            self.rewards.close()
        if self.reward_models:
            await self.reward_models.aclose()
        if self.teacher:
            await self.teacher.aclose()
        await self.clients.aclose()
