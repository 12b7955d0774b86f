"""Run the rollouts of one group on one server: the one path that training and evaluation share.

Invariant: `run_group` returns exactly `size` rollouts, one distinct object each, and raises only
when cancelled: any failure (an exception of the env, a wrong number of outputs, an untrainable
output) becomes a failed rollout that says why. Requests of the group's first turns are merged into
one `n` request where possible (`coalesce.py`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from prime_rl.orchestrator.envs.coalesce import grouped, rollout_slot
from prime_rl.orchestrator.envs.rewards import REWARD_ERROR
from prime_rl.orchestrator.envs.v1_env import V1Env
from prime_rl.orchestrator.envs.verifiers_adapter import from_verifiers
from prime_rl.orchestrator.envs_config import SamplingConfig
from prime_rl.orchestrator.rollout import Rollout, failed_rollout


def sampling_args(config: SamplingConfig, policy_version: int) -> dict[str, Any]:
    """Sampling args that make vLLM return token ids and logprobs (needed for training), with the
    prefix cache salted by the policy version: a server keeps its cache across weight reloads (for
    the requests in flight), and no new request may reuse a prefix computed by older weights."""
    return {
        "temperature": config.temperature,
        "top_p": config.top_p,
        "max_tokens": config.max_tokens,
        "logprobs": True,
        "extra_body": {
            "cache_salt": f"prime-rl-policy-{policy_version}",
            **config.extra_body,
            "return_token_ids": True,
        },
    }


@dataclass(frozen=True)
class GroupRun:
    """What to run: `size` rollouts of one example of one env, at one policy version."""

    env_name: str
    vf_env: Any
    inp: dict[str, Any]
    """The verifiers rollout input (prompt, example_id, answer, info, task)."""
    example_id: int | str
    size: int
    policy_version: int
    sampling: SamplingConfig
    state_columns: tuple[str, ...] = ()

    @property
    def group_scoring(self) -> bool:
        """Whether the rubric scores the group together (then one `run_group` call)."""
        return bool(getattr(self.vf_env, "requires_group_rollouts", False))


async def run_group(job: GroupRun, client, base_url: str, model: str, timeout_s: float) -> list[Rollout]:
    """The group's rollouts on the server at `base_url` (`client` is its verifiers client)."""
    args = sampling_args(job.sampling, job.policy_version)
    columns = ["trajectory", REWARD_ERROR, *job.state_columns]

    def convert(output: dict[str, Any]) -> Rollout:
        return from_verifiers(output, job.env_name, job.policy_version, list(job.state_columns))

    def failed(e: BaseException) -> Rollout:
        return failed_rollout(job.env_name, job.example_id, job.policy_version, f"{type(e).__name__}: {e}")

    if isinstance(job.vf_env, V1Env):  # its own client and harness: no request merging
        try:
            rollouts = await job.vf_env.run_group(
                job.inp,
                job.size,
                base_url,
                model,
                args,
                job.env_name,
                job.policy_version,
                list(job.state_columns),
                timeout_s,
            )
        except Exception as e:
            return [failed(e) for _ in range(job.size)]
        if len(rollouts) != job.size:
            return [
                failed(RuntimeError(f"the v1 env returned {len(rollouts)} rollouts for {job.size}"))
                for _ in range(job.size)
            ]
        return rollouts

    with grouped(job.size):
        if job.group_scoring:
            try:
                outputs = await job.vf_env.run_group(
                    [dict(job.inp) for _ in range(job.size)],
                    client,
                    model,
                    args,
                    state_columns=columns,
                )
                if len(outputs) != job.size:
                    raise RuntimeError(f"run_group returned {len(outputs)} outputs for {job.size} inputs")
                return [convert(o) for o in outputs]
            except Exception as e:
                return [failed(e) for _ in range(job.size)]

        async def one() -> Rollout:
            with rollout_slot():
                try:
                    output = await job.vf_env.run_rollout(
                        dict(job.inp), client, model, args, state_columns=columns
                    )
                    return convert(output)
                except Exception as e:
                    return failed(e)

        return list(await asyncio.gather(*(one() for _ in range(job.size))))
