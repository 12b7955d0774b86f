"""The orchestrator's step loop: collect a step's groups, build its batch, save, send, log.

One asyncio process. Per step: collect its groups (`collect.py`: follow the trainer's weights, drop
what is stale, dispatch what the policy lag allows, wait until the batch is full); build the batch
in a worker thread; write its rollouts and metrics, save it with the progress checkpoint (the
commit point) and stream it to the trainer ranks, while generation for the next steps goes on.
Invariant: a kill at any point leaves every committed step with one metrics record and its rollouts.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

from prime_rl.engine.local import LocalEngine
from prime_rl.model.local import num_experts
from prime_rl.orchestrator.advantages import build_advantage
from prime_rl.orchestrator.config import OrchestratorConfig, contract_side
from prime_rl.orchestrator.loop.collect import Collected, Collector
from prime_rl.orchestrator.loop.difficulty import DifficultyMemory
from prime_rl.orchestrator.loop.eval import Evaluator
from prime_rl.orchestrator.loop.handshake import wait_for_refusal
from prime_rl.orchestrator.loop.health import ServerHealth
from prime_rl.orchestrator.loop.pipeline import FinishedGroup, PipelineConfig, StepBuild, build_step
from prime_rl.orchestrator.loop.progress import (
    Progress,
    again_from_json,
    cursor_from_json,
    forget_uncommitted,
    load_batch,
    restore,
    rng_to_json,
    save_batch,
    save_progress,
)
from prime_rl.orchestrator.loop.records import step_records, write_jsonl
from prime_rl.orchestrator.loop.registry import Registry
from prime_rl.orchestrator.loop.resend import oldest_resume_step, steps_to_resend
from prime_rl.orchestrator.loop.scheduler import Accounting, Scheduler
from prime_rl.orchestrator.loop.sender import BatchSender
from prime_rl.orchestrator.loop.servers import ServerPool
from prime_rl.orchestrator.loop.step_metrics import (
    accounting_metrics,
    batch_metrics,
    dynamic_sampling_metrics,
    pool_metrics,
    rollout_metrics,
    step_line,
)
from prime_rl.orchestrator.loop.weights import Adapter, WeightSync
from prime_rl.orchestrator.loop.weights_dir import check_weights_dirs
from prime_rl.orchestrator.messages import EnvSide
from prime_rl.orchestrator.rollout import Rollout, most_common_failure
from prime_rl.runtime import activity, secret, shutdown
from prime_rl.runtime.disk import writing
from prime_rl.runtime.layout import (
    record_restart,
    refusal_path,
    restart_counts,
    weights_root,
)
from prime_rl.runtime.monitor import MetricsLogger
from prime_rl.transport.config import resolve_run_id
from prime_rl.transport.contract import ContractError
from prime_rl.transport.messages import MicroBatch, TrainingBatch
from prime_rl.transport.packing import pack

log = logging.getLogger("prime_rl.orchestrator")


class Orchestrator:
    def __init__(self, config: OrchestratorConfig, env_side: EnvSide, engine: LocalEngine | None = None):
        self.config = config
        self.env_side = env_side
        self.engine = engine
        """vLLM's engine in this process (engine mode), started in `setup`: the env side's transport."""
        self.output_dir = Path(config.output_dir)
        self.run_id = resolve_run_id(config.transport, config.output_dir)
        self.prev_acc = Accounting()
        self.stopped_by: signal.Signals | None = None
        """The signal that cancelled the run, if one did."""
        self.contract = contract_side(config, session=uuid.uuid4().hex[:12])
        self.refused: ContractError | None = None
        """The trainer's refusal of this orchestrator's contract, if it cancelled the run."""

    # ------------------------------------------------------------------ setup

    async def setup(self) -> Progress:
        c = self.config
        progress, rng, acc = restore(self.config)
        if self.engine is not None:
            # First: its processes fork from this one, which must not yet run the envs' threads.
            log.info("starting vLLM's engine in this process (%s)", c.model.name)
            activity.doing("starting vLLM's engine in this process", "inference")
            await self.engine.start()
        self.envs, evals = await self.env_side.start()
        self._take_signals()  # again: loading a verifiers env replaces the handlers
        self.advantages = {
            e.config.resolved_name: build_advantage(
                *(
                    (e.config.advantage, f"orchestrator.envs[{i}].advantage")
                    if e.config.advantage
                    else (c.advantage, "orchestrator.advantage")
                )
            )
            for i, e in enumerate(self.envs)
        }
        self.temperatures = {e.name: e.config.sampling.temperature for e in self.envs}
        self.pool = ServerPool(c.client, self.engine)
        log.info("checking inference at %s", ", ".join(s.base_url for s in self.pool.servers))
        activity.doing("waiting for the inference servers to answer", "inference")
        await self.pool.wait_healthy()
        await check_weights_dirs(self.pool, self.output_dir, adapter=c.lora_adapter is not None)
        self.pipeline = PipelineConfig(
            c.seq_len,
            c.min_group_size,
            tuple((f.type, f.monitor_only) for f in c.filters),
            c.reward_clip,
            c.teacher.advantage_weight if c.teacher else 1.0,
            c.teacher.weight if c.teacher else 0.0,
            num_experts(c.model.name) if c.return_routes else 0,
        )
        difficulty = DifficultyMemory(
            c.difficulty_filter, {k: dict(v) for k, v in progress.difficulty.items()}
        )
        cursors = {name: cursor_from_json(data) for name, data in progress.cursors.items()}
        again = again_from_json(progress.again)
        self.scheduler = Scheduler(
            c, self.envs, self.pool, self.env_side, rng, acc, difficulty, cursors, again
        )
        self.prev_skipped: Counter = Counter()
        self.prev_acc = Accounting.from_snapshot(acc.snapshot())
        adapter = (
            Adapter(c.lora_adapter, secret.owner_token(str(self.output_dir.resolve())))
            if c.lora_adapter
            else None
        )
        self.weights = WeightSync(
            weights_root(self.output_dir), self.pool, timeout_s=c.client.timeout_s, adapter=adapter
        )
        await self.weights.claim()
        await self.weights.poll()
        self.health = ServerHealth(
            self.pool,
            self.weights,
            c.client.health_interval_s,
            c.client.health_timeout_s,
            silent_s=c.client.silent_s,
            on_silent=self.scheduler.abandon,
            max_restarts=c.client.max_restarts,
            on_restart=lambda n: record_restart(self.output_dir, "inference", "engine", -9, n),
        )
        self.registry = None
        if c.pool.enabled:
            self.registry = Registry(c.pool, self.pool, self.weights, self.output_dir, self.scheduler.abandon)
            await self.registry.start()
        self._prev_groups: dict[str, int] = {}
        forget_uncommitted(self.output_dir, progress.step)
        self.metrics = MetricsLogger(
            self.output_dir / "orchestrator" / "metrics.jsonl", c.wandb, config=c.model_dump(mode="json")
        )
        self.evaluator = Evaluator(c, evals, self.pool, self.env_side, self.metrics) if evals else None
        self.collector = Collector(c, self.scheduler, self.pool, self.weights, self.health, self.evaluator)
        return progress

    def _take_signals(self) -> None:
        """SIGINT/SIGTERM cancel the run, which then stops cleanly (envs torn down, sockets closed)
        within `shutdown.GRACE_S`, or is ended then; a second signal changes nothing.

        Loading a verifiers env replaces these handlers with ones that schedule its teardown as a
        task and exit at once, so that teardown never ran ("Task was destroyed but it is pending").
        """
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only (tests run the orchestrator in threads)
        loop, task = asyncio.get_running_loop(), asyncio.current_task()

        def interrupt(sig: signal.Signals) -> None:
            if self.stopped_by is not None:  # a cancelled cleanup would leave env workers behind
                return
            self.stopped_by = sig
            shutdown.arm(sig)
            task.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, interrupt, sig)

    # ------------------------------------------------------------------ loop

    async def run(self) -> None:
        """The whole run. The trainer gets this orchestrator's side of the run contract first, and
        a refusal from it stops the run with the trainer's line, whatever the run is doing."""
        self._take_signals()
        beats = asyncio.create_task(activity.beat_loop(), name="activity-beat")
        self.sender = BatchSender(self.config)
        self.sender.hello(self.run_id, self.contract)
        watch = asyncio.create_task(self._stop_on_refusal(asyncio.current_task()), name="contract")
        try:
            await self._run()
        except asyncio.CancelledError:
            if self.refused is not None:
                raise self.refused from None
            raise
        finally:
            watch.cancel()
            beats.cancel()
            await self.sender.close(deliver=False)  # a no-op after a clean end
            if self.engine is not None:
                self.engine.close()

    async def _stop_on_refusal(self, main: asyncio.Task) -> None:
        self.refused = await wait_for_refusal(refusal_path(self.output_dir), self.contract.session)
        main.cancel()

    async def _run(self) -> None:
        try:
            progress = await self.setup()
        except BaseException:
            await self.env_side.close()  # workers started before the failure must not outlive it
            raise
        # What the setup loaded lives for the whole run: never walked again by a full collection
        # (~0.3 s stalls per few steps), collected first so that none of its garbage is frozen.
        gc.collect()
        gc.freeze()
        c = self.config
        monitor = asyncio.create_task(self.health.run(), name="server-health")
        try:
            await self._resend(progress.step)
            self._step_clock, self._send_s = time.perf_counter(), 0.0
            if self.evaluator and c.eval.at_start and progress.step == 0:
                self.evaluator.start(0, self.weights.version)
            for step in range(progress.step, c.max_steps):
                await self._step(step)
                if self.evaluator and (step + 1) % c.eval.interval == 0:
                    self.evaluator.start(step + 1, self.weights.version)
        except BaseException:
            monitor.cancel()
            if self.evaluator:
                self.evaluator.cancel()
            if self.registry:
                await self.registry.close()
            await self.scheduler.shutdown()
            await self.sender.close(deliver=False)
            self.metrics.close()
            await self.env_side.close()
            raise
        monitor.cancel()
        if self.registry:
            await self.registry.close(finished=True)
        await self.scheduler.shutdown()
        if self.evaluator:  # before the teardown: a v1 env's eval runs on servers its teardown stops
            await self.evaluator.finish()
        await self.weights.release()  # the run is over: its adapter name is free for another
        await self.env_side.close()
        await self.sender.close(deliver=True)
        self.metrics.close()

    async def _resend(self, next_step: int) -> None:
        """After a restart: send again the saved batches a (restarted) trainer may still need.

        Those are `loop/resend.py`'s: from the trainer's oldest kept checkpoint up to the last built
        step (the trainer skips any it already has), none when the trainer has finished.
        """
        c = self.config
        steps = await asyncio.to_thread(
            steps_to_resend, self.output_dir, next_step, self.weights.version, c.max_steps
        )
        for step in steps:
            batch = await asyncio.to_thread(load_batch, self.output_dir, step)
            if batch is None:
                log.warning("the saved batch of step %d is missing: it cannot be re-sent", step)
                continue
            await self.sender.send(await asyncio.to_thread(self._pack, batch))
            log.info("re-sent the saved batch of step %d", step)

    def _pack(self, batch: TrainingBatch) -> list[list[MicroBatch]]:
        return pack(
            batch.samples,
            self.config.seq_len,
            self.config.trainer_ranks,
            self.run_id,
            batch.header.step,
            orchestrator=self.contract,
        )

    async def _step(self, step: int) -> None:
        t0 = self._step_clock  # since the previous step's commit: its send belongs to this step's time
        collected = await self.collector.collect(step)
        activity.doing(f"step {step}: building, saving and sending its batch", "", step)
        built, per_rank = await asyncio.to_thread(self._build, collected.groups, step)
        # The step's records (rollouts, metrics line) are written before its commit point, the
        # progress save: a kill after it loses none, one before it has them rewritten by the rebuilt
        # step. Accounting and metrics are taken in one synchronous block, so the loop's callbacks
        # cannot move them apart.
        self.scheduler.account(built.counts)
        self.scheduler.check_accounting()
        progress = self._progress(step + 1)
        times = {**collected.times, "time/send": self._send_s, "time/step": time.perf_counter() - t0}
        self._log_step(step, built, per_rank, times, collected)
        failures = collected.failures
        if collected.short:
            log.warning(
                "step %d: dynamic sampling dropped %d groups whose rewards were all equal (max_backfill = %d); "
                "the step trains %d rollouts, not %d",
                step,
                len(collected.uniform),
                self.config.dynamic_sampling.max_backfill,
                sum(len(g.rollouts) for g in collected.groups),
                self.config.batch_size,
            )
        if len(failures) > self.config.failure_warning_fraction * self.config.batch_size:
            reason, count = most_common_failure(failures)
            log.warning(
                "step %d: %d rollouts failed, %d of them with %s (each one is in %s and rollouts/step_%06d.jsonl)",
                step,
                len(failures),
                count,
                reason,
                "the orchestrator log",
                step,
            )
        self._step_clock = time.perf_counter()
        await asyncio.to_thread(self._write_rollouts, step, built, failures, collected.uniform)
        await asyncio.to_thread(self._save, built.batch, progress)
        t1 = time.perf_counter()
        activity.doing(f"step {step}: sending its batch (the trainer takes it)", "trainer", step)
        await self.sender.send(per_rank)
        self._send_s = time.perf_counter() - t1

    def _build(self, groups: list[FinishedGroup], step: int) -> tuple[StepBuild, list[list[MicroBatch]]]:
        """The step's batch and its micro-batches per rank: one worker-thread hop per step."""
        built = build_step(groups, self.advantages, self.temperatures, self.pipeline, self.run_id, step)
        return built, self._pack(built.batch)

    def _progress(self, next_step: int) -> Progress:
        return Progress(
            step=next_step,
            accounting=self.scheduler.acc.snapshot(),
            cursors={
                name: [s.cursor.epoch, s.cursor.position] for name, s in self.scheduler.examples.items()
            },
            rng_state=rng_to_json(self.scheduler.rng),
            difficulty={env: dict(seen) for env, seen in self.scheduler.difficulty.extremes.items()},
            again=[[name, e.example_id, e.task] for name, e in self.scheduler.pending_examples()],
        )

    def _save(self, batch: TrainingBatch, progress: Progress) -> None:
        """The step's commit point: its batch, then the progress that says it is built."""
        with writing(self.output_dir / "orchestrator", f"the batch and progress of step {batch.header.step}"):
            save_batch(
                self.output_dir, batch, keep_from=oldest_resume_step(self.output_dir, self.weights.version)
            )
            save_progress(self.output_dir, progress)

    def _write_rollouts(
        self, step: int, built: StepBuild, failures: list[Rollout], uniform: list[FinishedGroup]
    ) -> None:
        records = step_records(step, built.groups, failures, uniform)
        write_jsonl(self.output_dir / "rollouts" / f"step_{step:06d}.jsonl", records)

    def _log_step(
        self, step: int, built: StepBuild, per_rank, times: dict[str, float], collected: Collected
    ) -> None:
        sched, c = self.scheduler, self.config
        envs = [e.name for e in self.envs]
        m = rollout_metrics(step, built.groups, envs)
        m.update(accounting_metrics(sched.acc, self.prev_acc, envs))
        m["rollouts/all/inflight"] = sched.inflight_rollouts
        m["rollouts/all/waiting"] = sched.ready_rollouts
        m.update({f"filter/{key}": n for key, n in built.filter_counts.items()})
        if c.difficulty_filter.enabled:
            for env in envs:
                m[f"difficulty/skipped/{env}"] = sched.skipped[env] - self.prev_skipped[env]
                m[f"difficulty/remembered/{env}"] = sched.difficulty.size(env)
            self.prev_skipped = Counter(sched.skipped)
        if c.dynamic_sampling.enabled:
            m.update(dynamic_sampling_metrics(collected.uniform, collected.short, envs))
        self.prev_acc = Accounting.from_snapshot(sched.acc.snapshot())
        m.update(batch_metrics(per_rank, c.seq_len))
        m["policy_version"] = self.weights.version
        m.update(pool_metrics(self.pool.servers, self._prev_groups))
        self._prev_groups = {s.name: s.groups for s in self.pool.servers}
        if c.adaptive_async.enabled:
            level = self.collector.async_level
            m["async/level"] = level.level
            if level.last_ess is not None:
                m["async/trainer_ess"] = level.last_ess
        # Processes `rl` restarted so far (deployment.max_restarts): a small file, read once a step.
        m.update({f"restarts/{kind}": n for kind, n in restart_counts(self.output_dir).items()})
        m.update({f"sandbox/{e.name}/off": 1 for e in self.envs if e.config.sandbox.runtime == "none"})
        m.update(times)
        m["throughput/tokens_per_s"] = m["batch/tokens"] / max(times["time/step"], 1e-9)
        self.metrics.log(step, m)
        log.info(step_line(step, m, envs))
