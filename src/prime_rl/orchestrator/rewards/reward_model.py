"""A learned reward model as one reward function of an env's rubric: its score of the rollout's
prompt and completion. Its config is here; what scores (one batched scorer per path or URL, shared
by every env and rollout of a process, local forward passes or a `reward-server`) is the env side's
(`orchestrator/envs/reward_model.py`), which binds it to the function as `scorer`.

Invariant: config and a thin function only; nothing here loads a model or opens a connection, so the
orchestrator's config and preflight can import it.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from prime_rl.config.plugins import Builtin
from prime_rl.model.reward import plain_messages
from prime_rl.orchestrator.rewards.base import RewardBase


class RewardModelReward(RewardBase):
    """A learned reward model scoring this env's rollouts, beside or instead of the env's rubric."""

    type: Literal["reward_model"]
    """Selects this reward function."""

    path: str | None = None
    """Local folder of a one-output *ForSequenceClassification model (e.g. made by
    `train-reward-model`), loaded once in the orchestrator."""

    url: str | None = None
    """Instead of `path`: base URL of a reward server (`uv run reward-server`, or anything that answers
    POST {url}/score {"conversations": [[prompt messages], [completion messages]], ...]} with
    {"scores": [...]} and GET {url}/health)."""

    env_reward_weight: float = 1.0
    """Factor on the weights of the env's own reward functions: 0 trains on the reward model alone,
    and the env's functions stay as metrics (`metric/<function>/<env>`) to check it against. The
    functions of `rewards` are not scaled."""

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
            raise ValueError("set exactly one of path (a local model) and url (a reward server)")
        return self

    @property
    def source(self) -> str:
        return self.path or self.url or ""


async def reward_model(prompt, completion, scorer: Any) -> float:
    """`scorer`: the env side's batcher of this model (`envs/reward_model.py`)."""
    return await scorer.score((plain_messages(prompt), plain_messages(completion)))


BUILTIN = Builtin("reward_model", reward_model, RewardModelReward)
