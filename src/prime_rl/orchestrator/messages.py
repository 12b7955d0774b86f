"""What the loop and the env side say to each other: the one contract between the two halves.

The loop (`loop/`) decides which group runs where and when; the env side (`envs/`) runs it and
answers with exactly `size` rollouts. In process the two call each other through `EnvSide`; with
env workers the same values travel as msgspec messages over zmq (`loop/workers.py`,
`envs/worker.py`). Invariant: a job is answered once, by a `GroupDone` with `size` rollouts (failed
ones say why), or not at all when it was cancelled; nothing else of an env crosses the boundary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import msgspec

from prime_rl.orchestrator.envs_config import EnvConfig, EvalEnvConfig
from prime_rl.orchestrator.rollout import Rollout


class Example(msgspec.Struct, frozen=True):
    """One task of an env's taskset as it travels: its position in the taskset (`idx`, the
    example id) and its data as JSON. The env side rebuilds the task from it, so no process lists
    the taskset to find a task again."""

    example_id: int | str
    task: dict[str, Any]


class GroupJob(msgspec.Struct, frozen=True):
    """Run `size` rollouts of one example of one env, at one policy version, on one server."""

    id: int
    env_name: str
    example_id: int | str
    task: dict[str, Any]
    """The example's task data (`Example.task`), which the env side rebuilds the task from."""
    size: int
    policy_version: int
    base_url: str
    """The inference server the loop leased for this group."""
    eval: bool = False
    """An eval env's group (its sampling and rubric are the eval env's)."""
    model: str = ""
    """The model name to request: the run's LoRA adapter (from version 1 on) or, empty, the
    configured model."""


class GroupDone(msgspec.Struct, tag=True):
    """A job's `size` rollouts (worker to loop)."""

    id: int
    rollouts: list[Rollout]


class Cancel(msgspec.Struct, tag=True):
    """Stop the job `id` (loop to worker): its rollouts can no longer train; no answer follows."""

    id: int


class Job(msgspec.Struct, tag=True):
    """A `GroupJob` for a worker (loop to worker)."""

    job: GroupJob


class Ready(msgspec.Struct, tag=True):
    """A worker loaded its envs and takes jobs (worker to loop)."""

    pid: int


class Broken(msgspec.Struct, tag=True):
    """A worker could not start; `message` says why in one line (worker to loop)."""

    message: str
    needs_user: bool
    """An error in the config or an env (exit status 2), not a passing fault."""


class Stop(msgspec.Struct, tag=True):
    """Finish: cancel what runs, tear the envs down and exit (loop to worker)."""


ToWorker = Job | Cancel | Stop
FromWorker = GroupDone | Ready | Broken


ConfigT = TypeVar("ConfigT", EnvConfig, EvalEnvConfig)
"""A training env's config or an eval env's."""


@dataclass(frozen=True)
class EnvView(Generic[ConfigT]):
    """An env as the loop sees it, a training env (`EnvView[EnvConfig]`) or an eval env
    (`EnvView[EvalEnvConfig]`): its config, its examples and how its rubric scores. The verifiers
    env itself stays on the env side (`envs.load.LoadedEnv`)."""

    config: ConfigT
    examples: Iterable[Example]
    """The env's tasks, read lazily from its taskset on each iteration (never listed)."""
    group_scoring: bool
    """The rubric scores the group together: one failed rollout drops the whole group."""

    @property
    def name(self) -> str:
        return self.config.resolved_name


class EnvSide(Protocol):
    """The env side as the loop drives it, in process (`envs.local.LocalEnvs`) or in workers
    (`loop.workers.WorkerPool`)."""

    async def start(self) -> tuple[list[EnvView[EnvConfig]], list[EnvView[EvalEnvConfig]]]:
        """Load the envs (and check the reward models and the teacher); their example streams."""
        ...

    async def run(self, job: GroupJob) -> list[Rollout]:
        """The job's `size` rollouts; raises only when cancelled."""
        ...

    async def close(self) -> None:
        """Tear the envs down (their teardown hooks run) and release clients and workers."""
        ...
