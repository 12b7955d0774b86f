"""The configs of the env side's own machinery: how reward functions run, a learned reward model,
the teacher of on-policy distillation.

Invariant: config only. This module imports pydantic and `prime_rl.config`, nothing of the env
side, so that the orchestrator's config, the loop and `rl` can name these sections without loading
what runs them (`envs/rewards.py`, `envs/reward_model.py`, `envs/teacher.py` import them from here).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from prime_rl.config import BaseConfig


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


class RewardModelConfig(BaseConfig):
    """A learned reward model scoring this env's rollouts, beside or instead of the env's rubric."""

    path: str | None = None
    """Local folder of a one-output *ForSequenceClassification model (e.g. made by
    `train-reward-model`), loaded once in the orchestrator."""

    url: str | None = None
    """Instead of `path`: base URL of a reward server (`uv run reward-server`, or anything that answers
    POST {url}/score {"conversations": [[prompt messages], [completion messages]], ...]} with
    {"scores": [...]} and GET {url}/health)."""

    weight: float = 1.0
    """Weight of the reward model's score in the rollout's reward."""

    env_reward_weight: float = 1.0
    """Factor on the weights of the env's own reward functions: 0 trains on the reward model alone,
    and the env's functions stay as metrics (`metric/<function>/<env>`) to check it against."""

    batch_size: int = Field(default=64, ge=1)
    """Most conversations scored in one forward pass or request."""

    max_wait_ms: float = Field(default=5.0, ge=0)
    """How long the first call of a batch waits for others to join it."""

    max_length: int = Field(default=1024, ge=8)
    """Tokens of a conversation a local model sees (the end of it)."""

    timeout_s: float = Field(default=30.0, gt=0)
    """A request to `url` failing to answer within this fails the attempt."""

    retries: int = Field(default=2, ge=0)
    """Further attempts of a failed request to `url` (connection errors, timeouts, 5xx), with backoff;
    after the last one the batch's rollouts fail with the reason."""

    connect_timeout_s: float = Field(default=10.0, gt=0)
    """At start-up, how long `url`'s health check may take before the run stops with an error."""

    @model_validator(mode="after")
    def _one_source(self):
        if (self.path is None) == (self.url is None):
            raise ValueError(
                "set exactly one of reward_model.path (a local model) and reward_model.url (a server)"
            )
        return self

    @property
    def source(self) -> str:
        return self.path or self.url or ""


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
