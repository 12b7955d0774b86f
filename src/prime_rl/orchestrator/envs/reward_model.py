"""What scores a reward model's rubric function, local or remote, batched.

`[[orchestrator.envs.rewards]] type = "reward_model"` adds the function `reward_model` to the env's
rubric (`env_rewards.py`; its config is `rewards/reward_model.py`). Every call from every rollout of
every env using the same model goes through one `Batcher`: calls arriving within `max_wait_ms` of each
other, up to `batch_size`, are scored together, by one forward pass in a worker thread (a local
model, loaded once) or one HTTP request (a `reward-server` URL, with a timeout and retries).

Invariant: a score that could not be computed raises in the rubric function, so the rollout fails
with the reason (through `RewardRunner`) instead of training on a made-up reward; the event loop
never runs a forward pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prime_rl.auth import clients
from prime_rl.model.reward import RewardModelError, load_reward_model
from prime_rl.orchestrator.envs.http_retry import post_json
from prime_rl.orchestrator.rewards import bind
from prime_rl.orchestrator.rewards.reward_model import RewardModelReward, reward_model
from prime_rl.runtime import tls

log = logging.getLogger("prime_rl.orchestrator")

Conversation = tuple[list[dict], list[dict]]
"""A rollout as the reward model sees it: prompt messages, completion messages."""


class Batcher:
    """Collects concurrent `score` calls into batches for one `score_batch` coroutine."""

    def __init__(
        self, score_batch: Callable[[list[Any]], Awaitable[list[float]]], batch_size: int, max_wait_s: float
    ):
        self.score_batch = score_batch
        self.batch_size = batch_size
        self.max_wait_s = max_wait_s
        self._pending: list[tuple[Any, asyncio.Future]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task] = set()
        self.batches = 0  # how many batches were scored (for tests and logs)

    async def score(self, item: Any) -> float:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if len(self._pending) >= self.batch_size:
            self._flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.max_wait_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.ensure_future(self._run(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, batch: list[tuple[Any, asyncio.Future]]) -> None:
        self.batches += 1
        try:
            scores = await self.score_batch([item for item, _ in batch])
            if len(scores) != len(batch):
                raise RewardModelError(f"got {len(scores)} scores for {len(batch)} conversations")
        except Exception as e:
            for _, future in batch:
                if not future.done():  # a caller that timed out has cancelled its future
                    future.set_exception(e)
            return
        for (_, future), score in zip(batch, scores, strict=True):
            if not future.done():
                future.set_result(float(score))

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()


class LocalScorer:
    """A reward model folder loaded in this process; forward passes in one worker thread."""

    def __init__(self, config: RewardModelReward, key: str):
        try:
            self.model = load_reward_model(config.path, config.max_length, threads=1)
        except RewardModelError as e:
            raise RewardModelError(f"{key}.path: {e}") from None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="reward-model")

    async def score_batch(self, conversations: list[Conversation]) -> list[float]:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self.model.score, conversations
        )

    async def aclose(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class RemoteScorer:
    """A reward server at a URL, asked with one POST per batch, with the run's secret
    (`runtime/secret.py`)."""

    def __init__(self, config: RewardModelReward, key: str):
        import httpx

        self.config = config
        self.key = key
        self.base = config.url.rstrip("/")
        self._client = httpx.AsyncClient(timeout=config.timeout_s, verify=tls.context(), auth=clients.auth())

    async def check(self) -> None:
        """Fail fast, naming the key, when the server does not answer its health route."""
        import httpx

        try:
            response = await self._client.get(f"{self.base}/health", timeout=self.config.connect_timeout_s)
            response.raise_for_status()
        except httpx.TimeoutException:
            raise RewardModelError(
                f"{self.key}.url: {self.config.url} did not answer within "
                f"{self.config.connect_timeout_s:g}s ({self.key}.connect_timeout_s)"
            ) from None
        except httpx.HTTPError as e:
            raise RewardModelError(
                f"{self.key}.url: {self.config.url} is not a reward server: {type(e).__name__}: {e}"
            ) from None

    async def score_batch(self, conversations: list[Conversation]) -> list[float]:
        payload = {"conversations": [[p, c] for p, c in conversations]}
        answer = await post_json(
            self._client,
            f"{self.base}/score",
            payload,
            retries=self.config.retries,
            timeout_s=self.config.timeout_s,
            what=f"reward server {self.config.url}",
            error=RewardModelError,
        )
        scores = answer.get("scores") if isinstance(answer, dict) else None
        if not isinstance(scores, list):
            raise RewardModelError(f"reward server {self.config.url}: the answer has no 'scores' list")
        return scores

    async def aclose(self) -> None:
        await self._client.aclose()


class RewardModels:
    """The reward models of one orchestrator: one scorer and batcher per path or URL, shared by envs."""

    def __init__(self):
        self._batchers: dict[str, Batcher] = {}
        self._scorers: list[LocalScorer | RemoteScorer] = []

    def batcher(self, config: RewardModelReward, key: str) -> Batcher:
        if config.source not in self._batchers:
            scorer = LocalScorer(config, key) if config.path else RemoteScorer(config, key)
            self._scorers.append(scorer)
            self._batchers[config.source] = Batcher(
                scorer.score_batch, config.batch_size, config.max_wait_ms / 1000
            )
        return self._batchers[config.source]

    async def check(self) -> None:
        for scorer in self._scorers:
            if isinstance(scorer, RemoteScorer):
                await scorer.check()

    async def aclose(self) -> None:
        for batcher in self._batchers.values():
            await batcher.aclose()
        for scorer in self._scorers:
            await scorer.aclose()


def reward_function(batcher: Batcher, name: str = "reward_model"):
    """The rubric function: one rollout's prompt and completion, scored through the batcher."""
    return bind(reward_model, {"scorer": batcher}, name)
