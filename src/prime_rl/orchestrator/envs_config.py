"""The configs of the env side's own machinery: how reward functions run, the teacher of on-policy
distillation (the reward functions themselves, a reward model among them, are `rewards/`).

Invariant: config only. This module imports pydantic and `prime_rl.config`, nothing of the env
side, so that the orchestrator's config, the loop and `rl` can name these sections without loading
what runs them (`envs/rewards.py`, `envs/teacher.py` import them from here).
"""

from __future__ import annotations

from pydantic import Field

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
