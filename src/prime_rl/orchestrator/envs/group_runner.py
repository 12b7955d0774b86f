"""Run the rollouts of one group on one server: the one path that training and evaluation share.

Invariant: `run_group` returns exactly `size` rollouts, one distinct object each, and raises only
when cancelled: any failure (an exception of the env, a wrong number of outputs, an untrainable
trace) becomes a failed rollout that says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prime_rl.engine.sampling import SamplingArgs
from prime_rl.orchestrator.envs.v1_env import V1Env
from prime_rl.orchestrator.envs_config import SamplingConfig
from prime_rl.orchestrator.rollout import Rollout, failed_rollout


def sampling_args(config: SamplingConfig, policy_version: int) -> SamplingArgs:
    """An env's sampling args, with the prefix cache salted by the policy version: a server keeps
    its cache across weight reloads (for the requests in flight), and no new request may reuse a
    prefix computed by older weights."""
    return SamplingArgs(
        temperature=config.temperature,
        top_p=config.top_p,
        max_tokens=config.max_tokens,
        cache_salt=f"prime-rl-policy-{policy_version}",
        extra=dict(config.extra_body),
    )


@dataclass(frozen=True)
class GroupRun:
    """What to run: `size` rollouts of one example of one env, at one policy version."""

    env_name: str
    vf_env: V1Env
    task: Any
    """The example's task (a verifiers v1 `Task`)."""
    example_id: int | str
    size: int
    policy_version: int
    sampling: SamplingConfig
    state_columns: tuple[str, ...] = ()
    merge_first_turns: bool = True

    @property
    def group_scoring(self) -> bool:
        return bool(getattr(self.vf_env, "requires_group_rollouts", False))


async def run_group(job: GroupRun, sampler, renderer, model: str, timeout_s: float) -> list[Rollout]:
    """The group's rollouts, sampled by `sampler` (`sampler.py`) from `model` (the policy, or its
    adapter), their prompts rendered by `renderer` (the policy's chat template)."""

    def failed(reason: str) -> list[Rollout]:
        return [
            failed_rollout(job.env_name, job.example_id, job.policy_version, reason) for _ in range(job.size)
        ]

    try:
        rollouts = await job.vf_env.run_group(
            job.task,
            job.example_id,
            job.size,
            sampler,
            renderer,
            model,
            sampling_args(job.sampling, job.policy_version),
            job.env_name,
            job.policy_version,
            list(job.state_columns),
            timeout_s,
            job.merge_first_turns,
        )
    except Exception as e:
        return failed(f"{type(e).__name__}: {e}")
    if len(rollouts) != job.size:
        return failed(f"RuntimeError: the env returned {len(rollouts)} rollouts for {job.size}")
    return rollouts
