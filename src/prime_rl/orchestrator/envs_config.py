"""The envs' sections of the orchestrator's config: each env trained on (`envs`) or evaluated
(`eval`), with its sampling, and the env side's own machinery: how reward functions run, the teacher
of on-policy distillation (the reward functions themselves, a reward model among them, are
`rewards/`; the advantage functions `advantages/`).

Invariant: config only. This module imports pydantic, `prime_rl.config` and the configs of the
advantage and reward registries, nothing of the loop or the env side, so that the orchestrator's
config, the loop, the env workers and `rl` can name these sections without loading what runs them
(`envs/load.py`, `envs/rewards.py`, `envs/teacher.py` import them from here).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from prime_rl.config import BaseConfig
from prime_rl.orchestrator.advantages import AdvantageConfig
from prime_rl.orchestrator.rewards import RewardConfig
from prime_rl.sandbox.config import SandboxConfig


class SamplingConfig(BaseConfig):
    """Sampling arguments sent with every rollout request of an env."""

    temperature: float = Field(default=1.0, ge=0)
    """Sampling temperature (the trainer recomputes logprobs at this temperature)."""

    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus sampling threshold."""

    max_tokens: int = Field(default=128, ge=1)
    """Maximum completion tokens per turn."""

    extra_body: dict[str, Any] = {}
    """Extra vLLM request fields, merged into the request as is (e.g. {min_tokens = 1})."""


class EnvConfig(BaseConfig):
    """One verifiers environment mixed into training."""

    moved_keys: ClassVar[dict[str, str]] = {
        "reward_model": "a reward model is one of the env's reward functions now: write it as "
        '[[orchestrator.envs.rewards]] with type = "reward_model" and the same fields '
        '(inline: rewards = [{type = "reward_model", path = ...}])',
    }

    id: str
    """The env's package (importable, e.g. `reverse-text`), which exports a verifiers v1 `Taskset`."""

    name: str | None = None
    """Name used in logs, metrics and rollouts; defaults to the id."""

    args: dict[str, Any] = {}
    """The taskset's config (its `TasksetConfig` fields, checked when the env loads)."""

    sandbox: SandboxConfig = SandboxConfig()
    """Where the env's tools run: a local sandbox (bubblewrap: no network, none of the run's files or
    variables, limits; one tool host per env worker, a session per rollout), or, with
    `runtime = "none"`, the env worker's own process with the run's full rights."""

    shuffle_buffer: int = Field(default=10_000, ge=1)
    """Tasks held to shuffle the taskset's stream each epoch: a taskset no longer than this is
    shuffled uniformly, a longer one within a window of this many (the taskset is never listed)."""

    ratio: float = Field(default=1.0, gt=0)
    """Relative share of this env's groups in each step."""

    group_size: int = Field(default=8, ge=1)
    """Rollouts per example (the G of GRPO)."""

    sampling: SamplingConfig = SamplingConfig()
    """Sampling arguments for this env's rollouts."""

    state_columns: list[str] = []
    """Extra rollout state fields saved with this env's rollouts."""

    advantage: AdvantageConfig | None = None
    """Advantage function for this env; defaults to the orchestrator's `advantage`."""

    rewards: list[RewardConfig] = []
    """Reward functions added to this env's own, each with its `weight`: a
    built-in by `type` ('reward_model': a learned reward model; 'length': DAPO's overlong penalty)
    or your own verifiers-style function as 'package.module:function' with `kwargs`."""

    @property
    def resolved_name(self) -> str:
        return self.name or self.id


class EvalEnvConfig(BaseConfig):
    """One env evaluated on its first `num_examples` tasks."""

    id: str
    """The env's package, which exports a verifiers v1 `Taskset`."""

    name: str | None = None
    """Name in metrics (`eval/<name>/...`); defaults to the id."""

    args: dict[str, Any] = {}
    """The taskset's config, e.g. `{ split = "eval" }`."""

    num_examples: int = Field(default=32, ge=1)
    """The taskset's first tasks evaluated each evaluation."""

    sandbox: SandboxConfig = SandboxConfig()
    """Where the env's tools run (as a training env's `sandbox`)."""

    rollouts_per_example: int = Field(default=1, ge=1)
    """Rollouts per eval example."""

    sampling: SamplingConfig = SamplingConfig(temperature=0.0)
    """Sampling for evaluation (greedy by default)."""

    @property
    def resolved_name(self) -> str:
        return self.name or self.id


class EvalConfig(BaseConfig):
    """Periodic evaluation; it runs beside training and never holds up a step."""

    envs: list[EvalEnvConfig] = []
    """Envs to evaluate; empty disables evaluation."""

    interval: int = Field(default=10, ge=1)
    """Evaluate every this many steps."""

    at_start: bool = False
    """Also evaluate the initial policy before the first step."""


class RewardsConfig(BaseConfig):
    """How reward functions run: in worker threads, bounded and timed."""

    concurrency: int = Field(default=1, ge=1)
    """Plain (sync) reward function calls running at once, one worker thread each. Threads share the
    GIL with the event loop: for rewards that compute in Python, more threads add loop lag, not
    speed (a 50 ms reward: p99 lag 32 ms with 1 thread, 57 ms with 2, on one core); for rewards that
    wait (a blocking HTTP judge, a subprocess), raise it. An `async def` reward that awaits its I/O
    needs no thread and is not bounded by this."""

    timeout_s: float = Field(default=60.0, gt=0)
    """A reward function call running longer fails its rollout(s) with a timeout."""

    inline_below_ms: float = Field(default=0.5, ge=0)
    """A plain reward function whose first 32 calls each took less than this runs on the event loop
    from then on, without the thread hop (which costs more than such a function: ~0.1 ms of CPU per
    call); a call that takes longer sends it back to the threads for good. Inline calls are not timed
    out: a function that was fast 32 times and then hangs would stall its process. 0: always threads."""


class TeacherConfig(BaseConfig):
    """A teacher whose per-token logprobs on the student's samples become advantages."""

    base_url: str = "http://127.0.0.1:8001/v1"
    """The teacher's OpenAI-compatible vLLM server (`rl` starts one and sets this when `[teacher]` is given)."""

    model: str = ""
    """The teacher's model name as its server knows it (`rl` sets it); when it is a local folder, its
    tokenizer must be the student's, which is checked at start."""

    weight: float = Field(default=1.0, ge=0)
    """Factor on the per-token term log p_teacher - log p_student."""

    advantage_weight: float = Field(default=0.0, ge=0)
    """Factor on the env's per-rollout advantage: 0 distills only; 1 adds distillation to RL."""

    timeout_s: float = Field(default=60.0, gt=0)
    """A teacher request answering later than this fails the attempt."""

    retries: int = Field(default=2, ge=0)
    """Further attempts of a failed teacher request (connection errors, timeouts, 5xx)."""

    concurrency: int = Field(default=32, ge=1)
    """Teacher requests in flight at once."""
