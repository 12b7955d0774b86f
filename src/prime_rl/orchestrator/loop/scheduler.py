"""Keep the inference servers busy with groups of rollouts, within the policy-lag bound.

A group is the `group_size` rollouts of one (env_name, example_id), dispatched together to one
server at the current policy version v. New groups are dispatched while the step s they would land
in has `s - v <= max_async_level` and fewer than `max_inflight_rollouts` are in flight; so
generation runs ahead of the trainer by at most `max_async_level` steps, and `max_async_level = 0`
is fully synchronous. Weight updates do not interrupt a rollout (the server keeps it across the
reload), so v is the oldest policy version among its tokens. The bound that drops rollouts is
checked at training time: a group trains step s only if `s - v <= max_off_policy_steps` (by
default one more than `max_async_level`, so a group that finishes a step later than planned still
trains); in-flight groups are cancelled only once they are past it.

When every rollout of a group is back:
- individual scoring: failed rollouts are dropped, the survivors form a (partial) group;
- group scoring: any failure drops the whole group;
- no survivors: dropped; `max_failed_groups` such groups of one env in a row stop the run
  (`failures.py`), so an env that fails every rollout never spins;
- with dynamic sampling, survivors whose rewards are all equal: dropped as filtered at once, so the
  step's count of ready rollouts does not include them and `fill` samples a replacement. Past
  `max_backfill` such groups since the last batch, the next batch is taken with what is ready.
The scheduler only dispatches, collects, drops and accounts: advantages, filters and samples are
the pipeline's (`pipeline.py`), which reports back how many of a batch trained and were filtered.

Invariant (checked every step): every dispatched rollout is in exactly one place: in flight,
finished and waiting for a batch, handed out in a batch that is not yet accounted, or counted
once as trained, filtered, failed or stale.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter, deque
from dataclasses import dataclass, field

from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs_config import EnvConfig
from prime_rl.orchestrator.loop.difficulty import DifficultyMemory
from prime_rl.orchestrator.loop.examples import Cursor, ExampleSource
from prime_rl.orchestrator.loop.failures import SERVER_LOST, SERVER_SILENT, FailureStreak
from prime_rl.orchestrator.loop.pipeline import FinishedGroup
from prime_rl.orchestrator.loop.servers import Server, ServerPool
from prime_rl.orchestrator.loop.weights import request_model
from prime_rl.orchestrator.messages import EnvSide, EnvView, Example, GroupJob
from prime_rl.orchestrator.rollout import Rollout, failed_rollout
from prime_rl.runtime.logging_setup import ROLLOUT_FAILED

log = logging.getLogger(__name__)

BUCKETS = ("trained", "filtered", "failed", "stale")


@dataclass
class Group:
    id: int
    env: EnvView[EnvConfig]
    example_id: int | str
    policy_version: int
    size: int
    server: Server
    example: Example
    """The example itself (to dispatch it again, `Scheduler.abandon`)."""
    rollouts: list[Rollout] = field(default_factory=list)
    """Once back: the surviving rollouts."""

    @property
    def env_name(self) -> str:
        return self.env.name


@dataclass
class Accounting:
    """Per-env bucket counts; `dispatched` minus the buckets is what is still in flight or waiting."""

    dispatched: Counter = field(default_factory=Counter)
    buckets: dict[str, Counter] = field(default_factory=lambda: {b: Counter() for b in BUCKETS})

    def add(self, bucket: str, env: str, n: int = 1) -> None:
        if n:
            self.buckets[bucket][env] += n

    def snapshot(self) -> dict[str, dict[str, int]]:
        return {"dispatched": dict(self.dispatched), **{b: dict(c) for b, c in self.buckets.items()}}

    @classmethod
    def from_snapshot(cls, data: dict[str, dict[str, int]]) -> Accounting:
        acc = cls(Counter(data.get("dispatched", {})))
        for b in BUCKETS:
            acc.buckets[b] = Counter(data.get(b, {}))
        return acc


@dataclass(frozen=True)
class Taken:
    """A step's groups as the scheduler hands them over, with what was dropped meanwhile."""

    groups: list[FinishedGroup]
    failures: list[Rollout]
    """Rollouts that failed since the last batch."""
    uniform: list[FinishedGroup]
    """Groups dynamic sampling dropped since the last batch (already counted as filtered)."""
    short: bool = False
    """Fewer than batch_size rollouts: dynamic sampling gave up waiting (`max_backfill`)."""


def run_on(env_side: EnvSide, pool: ServerPool, server: Server, job: GroupJob) -> asyncio.Task:
    """Run `job` on `server` as a task. The server carries the group's load from now until the
    task is done, however it ends (even cancelled before it started); a group whose every rollout
    failed makes the server suspect, so no more work goes to a dead server before it is checked."""
    server.inflight += job.size
    server.groups += 1

    async def run() -> list[Rollout]:
        rollouts = await env_side.run(job)
        if all(r.failed for r in rollouts):
            pool.suspect(server)
        return rollouts

    task = asyncio.create_task(run(), name=f"group-{job.id}")
    task.add_done_callback(lambda _: setattr(server, "inflight", server.inflight - job.size))
    return task


def is_uniform(rollouts: list[Rollout]) -> bool:
    """All rewards equal (to float noise): no group baseline can tell the rollouts apart."""
    rewards = [r.reward for r in rollouts]
    return max(rewards) - min(rewards) < 1e-8


class Scheduler:
    def __init__(
        self,
        config: OrchestratorConfig,
        envs: list[EnvView[EnvConfig]],
        pool: ServerPool,
        env_side: EnvSide,
        rng: random.Random,
        accounting: Accounting | None = None,
        difficulty: DifficultyMemory | None = None,
        cursors: dict[str, Cursor] | None = None,
        again: list[tuple[str, Example]] = (),
    ):
        self.config = config
        self.envs = envs
        self.examples = {
            e.name: ExampleSource(
                e.examples, config.seed, (cursors or {}).get(e.name), e.config.shuffle_buffer, e.name
            )
            for e in envs
        }
        """Each env's example stream, from its saved cursor (`cursors`, by env name) on."""
        self.pool = pool
        self.env_side = env_side
        self.rng = rng
        self.acc = accounting or Accounting()
        self.inflight: dict[asyncio.Task, Group] = {}
        self.ready: deque[Group] = deque()
        self._next_group_id = 0
        self._next_env: EnvView[EnvConfig] | None = None
        self._failures: list[Rollout] = []
        """Failed rollouts since the last batch was taken (they go with it, for the rollouts log)."""
        self._uniform: list[FinishedGroup] = []
        """Groups dynamic sampling dropped since the last batch (they go with it, for the log)."""
        self._unaccounted = 0
        """Rollouts handed out in batches whose trained/filtered counts are not yet in."""
        self._weights = [e.config.ratio for e in envs]
        self.difficulty = difficulty or DifficultyMemory(config.difficulty_filter)
        self.skipped: Counter = Counter()
        """Examples the difficulty filter skipped, per env, since the start of this process."""
        self.streak = FailureStreak(config.max_failed_groups, config.client.health_timeout_s)
        by_name = {e.name: e for e in envs}
        self._again = deque((by_name[name], example) for name, example in again if name in by_name)
        """Examples whose groups were lost with a server (or with the previous orchestrator process,
        `again`): dispatched again first."""

    # ---------------------------------------------------------------- counts

    @property
    def inflight_rollouts(self) -> int:
        return sum(g.size for g in self.inflight.values())

    @property
    def ready_rollouts(self) -> int:
        return sum(len(g.rollouts) for g in self.ready)

    def check_accounting(self) -> None:
        accounted = sum(sum(c.values()) for c in self.acc.buckets.values())
        dispatched = sum(self.acc.dispatched.values())
        pending = self.inflight_rollouts + self.ready_rollouts + self._unaccounted
        if dispatched != accounted + pending:
            raise AssertionError(
                f"rollout accounting broken: dispatched {dispatched} != accounted {accounted} + pending {pending}"
            )

    def pending_examples(self) -> list[tuple[str, Example]]:
        """(env name, example) of every example a crash now would lose: waiting to be dispatched
        again, in flight, or back but not in a batch yet (saved with the progress)."""
        groups = [*self.inflight.values(), *self.ready]
        return [(env.name, e) for env, e in self._again] + [(g.env_name, g.example) for g in groups]

    # ---------------------------------------------------------------- dispatch

    @property
    def last_failure(self) -> str | None:
        return self._failures[-1].error if self._failures else None

    def fill(self, step: int, policy_version: int, async_level: int | None = None) -> int:
        """Dispatch groups at `policy_version` (what the servers serve) while the policy lag (at most
        `async_level`, default `max_async_level`) and the in-flight limit allow; return how many."""
        n = 0
        c = self.config
        level = c.max_async_level if async_level is None else async_level
        while True:
            # The env is drawn once and kept until it can be dispatched, so that the RNG advances
            # only with dispatches, not with how often the loop happens to look.
            again = self._again[0] if self._again else None
            if again is None and self._next_env is None:
                self._next_env = self.rng.choices(self.envs, weights=self._weights)[0]
            env = again[0] if again else self._next_env
            if (
                # Training's own in-flight count: evaluation borrows the servers without blocking it.
                self.inflight_rollouts + env.config.group_size > c.max_inflight_rollouts and self.inflight
            ):
                return n
            target = step + (self.inflight_rollouts + self.ready_rollouts) // c.batch_size
            if target >= c.max_steps or target - policy_version > level:
                return n
            if self.pool.pick() is None:
                return n  # no server is up: the health monitor is bringing one back
            if again:
                self._again.popleft()
            else:
                self._next_env = None
            self._dispatch(env, policy_version, again[1] if again else None)
            n += 1

    def _next_example(self, env: EnvView[EnvConfig]) -> Example:
        """The env's next example the difficulty filter does not skip; after a whole epoch of skips
        (every example remembered as too easy or too hard) the next one is used anyway."""
        examples = self.examples[env.name]
        example, drawn = examples.next(), 1
        while self.difficulty.skips(env.name, example.example_id):
            if examples.epoch_size is not None and drawn > examples.epoch_size:
                break
            self.skipped[env.name] += 1
            example, drawn = examples.next(), drawn + 1
        return example

    def _dispatch(self, env: EnvView[EnvConfig], policy_version: int, example: Example | None = None) -> None:
        if example is None:
            example = self._next_example(env)
        server = self.pool.pick()
        assert server is not None
        job = GroupJob(
            self._next_group_id,
            env.name,
            example.example_id,
            example.task,
            env.config.group_size,
            policy_version,
            server.base_url,
            model=request_model(self.config.model.name, self.config.lora_adapter, policy_version),
        )
        group = Group(job.id, env, job.example_id, job.policy_version, job.size, server, example)
        self._next_group_id += 1
        self.acc.dispatched[env.name] += group.size
        task = run_on(self.env_side, self.pool, server, job)
        self.inflight[task] = group

    # ---------------------------------------------------------------- collect

    async def wait(self, timeout: float) -> None:
        """Wait until at least one group finishes (or the timeout passes), and finalize what finished."""
        if not self.inflight:
            await asyncio.sleep(timeout)
            return
        done, _ = await asyncio.wait(
            self.inflight.keys(), timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
        for task in done:
            group = self.inflight.pop(task, None)
            if group is not None:  # (None: abandoned meanwhile, already finalized)
                rollouts = task.result()
                if group.server.lost and all(r.failed for r in rollouts):
                    why = f"{SERVER_LOST}: inference server {group.server.root_url} died under the group"
                    rollouts = self._again_later(group, why)
                self._finalize(group, rollouts)

    def abandon(self, server: Server) -> int:
        """`server` stopped answering (or died, or leaves): its groups in flight fail now (counted,
        as failed), rather than each request waiting out its timeout, and their examples are
        dispatched again first, as are those of its groups that came back with every rollout failed.
        Returns the number of groups."""
        lost = [(task, g) for task, g in self.inflight.items() if g.server is server]
        reason = f"{SERVER_SILENT}: inference server {server.root_url} stopped answering"
        n = 0
        for task, group in lost:
            del self.inflight[task]
            if task.done() and not task.cancelled():  # back before it fell silent: keep what it got
                rollouts = task.result()
                if all(r.failed for r in rollouts):
                    rollouts = self._again_later(group, reason)
                self._finalize(group, rollouts)
                continue
            task.cancel()
            self._finalize(group, self._again_later(group, reason))
            n += 1
        return n

    def _again_later(self, group: Group, reason: str) -> list[Rollout]:
        """`group` was lost with its server: its example goes to the next dispatch, and its rollouts
        fail for `reason`, which counts as unreachable (bounded by time, not by `max_failed_groups`:
        a server that dies fails every group on it at once)."""
        self._again.append((group.env, group.example))
        return [
            failed_rollout(group.env_name, group.example_id, group.policy_version, reason)
            for _ in range(group.size)
        ]

    def _finalize(self, group: Group, rollouts: list[Rollout]) -> None:
        name = group.env_name
        failures = [r for r in rollouts if r.failed]
        self._failures.extend(failures)
        for r in failures:
            log.info("%s %s example %s: %s", ROLLOUT_FAILED, name, r.example_id, (r.error or "")[:500])
        self.streak.record(name, rollouts)
        if failures and group.env.group_scoring:
            self.acc.add("failed", name, len(rollouts))
            return
        self.acc.add("failed", name, len(failures))
        group.rollouts = [r for r in rollouts if not r.failed]
        self.difficulty.record(name, group.example_id, [r.reward for r in group.rollouts])
        if group.rollouts and self.config.dynamic_sampling.enabled and is_uniform(group.rollouts):
            self.acc.add("filtered", name, len(group.rollouts))
            self._uniform.append(FinishedGroup(name, group.example_id, tuple(group.rollouts)))
        elif group.rollouts:
            self.ready.append(group)

    @property
    def starving(self) -> bool:
        """Dynamic sampling dropped more than `max_backfill` groups since the last batch."""
        ds = self.config.dynamic_sampling
        return ds.enabled and len(self._uniform) > ds.max_backfill

    def drop_stale(self, step: int) -> int:
        """Drop finished groups and cancel in-flight ones that can no longer train step >= `step`
        (policy version older than `max_off_policy_steps` allows)."""
        oldest = step - self.config.off_policy_bound
        n = 0
        keep: deque[Group] = deque()
        for g in self.ready:
            if g.policy_version < oldest:
                self.acc.add("stale", g.env_name, len(g.rollouts))
                n += len(g.rollouts)
            else:
                keep.append(g)
        self.ready = keep
        for task, g in list(self.inflight.items()):
            if g.policy_version < oldest:
                task.cancel()
                del self.inflight[task]
                self.acc.add("stale", g.env_name, g.size)
                n += g.size
        return n

    def take_batch(self) -> Taken | None:
        """Whole groups, oldest first, once they hold at least `batch_size` rollouts (or whatever is
        ready once `starving`), with the failed rollouts and dropped uniform groups since the last
        batch; else None. Account for the groups with `account` once built."""
        if self.ready_rollouts < self.config.batch_size and not self.starving:
            return None
        batch, n = [], 0
        while n < self.config.batch_size and self.ready:
            g = self.ready.popleft()
            batch.append(FinishedGroup(g.env_name, g.example_id, tuple(g.rollouts)))
            n += len(g.rollouts)
        self._unaccounted += n
        failures, self._failures = self._failures, []
        uniform, self._uniform = self._uniform, []
        return Taken(batch, failures, uniform, short=n < self.config.batch_size)

    def account(self, buckets: dict[str, Counter]) -> None:
        """The trained and filtered counts per env of a batch from `take_batch`."""
        for bucket, per_env in buckets.items():
            for env, n in per_env.items():
                self.acc.add(bucket, env, n)
                self._unaccounted -= n

    async def shutdown(self) -> None:
        """Cancel what is in flight and count it, and what waits unused, as stale."""
        for task, g in self.inflight.items():
            task.cancel()
            self.acc.add("stale", g.env_name, g.size)
        await asyncio.gather(*self.inflight.keys(), return_exceptions=True)
        self.inflight.clear()
        for g in self.ready:
            self.acc.add("stale", g.env_name, len(g.rollouts))
        self.ready.clear()
        self._uniform.clear()  # already counted as filtered
