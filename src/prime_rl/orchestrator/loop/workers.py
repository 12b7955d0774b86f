"""The env side in `env_workers` processes: the loop's handle on them, behind the `EnvSide` contract.

Each worker (`envs/worker.py`, started as its own Python process) loads the envs and runs the groups
it is sent; the loop keeps scheduling, accounting and everything after a group is back. A job goes
to the worker with the fewest rollouts in flight, over a zmq PAIR socket per worker (ipc, in a
private folder), and comes back as a msgspec `GroupDone`.

Invariants:
- every job handed to `run` is answered exactly once: by its worker, or, when that worker dies
  first, with `size` failed rollouts that say so (they count as failed, and the group is finalized
  by the scheduler's usual rules); the dead worker's socket is closed, so nothing of it arrives
  late, and a new worker takes its place;
- a worker that cannot load the envs is the same one-line `EnvError` as in process; a worker that
  dies `MAX_QUICK_DEATHS` times in a row before serving a minute is `WorkersFailing`;
- no worker outlives the loop: `close` stops them (then kills what does not stop), and each worker
  also exits when its parent process is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from prime_rl.environments import EnvError
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs_config import EnvConfig, EvalEnvConfig
from prime_rl.orchestrator.loop.failures import WORKER_DIED
from prime_rl.orchestrator.messages import (
    Broken,
    Cancel,
    EnvSide,
    EnvView,
    FromWorker,
    GroupDone,
    GroupJob,
    Job,
    Ready,
    Stop,
)
from prime_rl.orchestrator.rollout import Rollout, failed_rollout

log = logging.getLogger("prime_rl.orchestrator")

WORKER_MODULE = "prime_rl.orchestrator.envs.worker"
MAX_QUICK_DEATHS = 3
QUICK_S = 60.0
STOP_TIMEOUT_S = 30.0


class WorkersFailing(RuntimeError):
    """Env workers keep dying right after they start: the run cannot go on."""


@dataclass
class Worker:
    index: int
    generation: int = 0
    proc: asyncio.subprocess.Process | None = None
    sock: zmq.asyncio.Socket | None = None
    jobs: dict[int, tuple[GroupJob, asyncio.Future]] = field(default_factory=dict)
    ready: bool = False
    started_at: float = 0.0
    quick_deaths: int = 0
    reader: asyncio.Task | None = None

    @property
    def inflight(self) -> int:
        return sum(job.size for job, _ in self.jobs.values())


class WorkerPool:
    """`EnvSide` over `config.env_workers` worker processes; `tasks` is an in-process env side
    that only loads the envs' task streams for the loop (`LocalEnvs(config, rollouts=False)`)."""

    def __init__(self, config: OrchestratorConfig, tasks: EnvSide):
        self.config = config
        self.tasks = tasks
        self.workers = [Worker(i) for i in range(config.env_workers)]
        self._ctx = zmq.asyncio.Context()
        self._encode = msgspec.msgpack.Encoder().encode
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        self._dir: Path | None = None
        self._closing = False
        self._error: BaseException | None = None
        self._some_ready = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.restarts = 0
        """Workers started again after one died."""

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> tuple[list[EnvView[EnvConfig]], list[EnvView[EvalEnvConfig]]]:
        envs = await self.tasks.start()
        self._dir = Path(tempfile.mkdtemp(prefix="prime-rl-workers-"))
        (self._dir / "config.json").write_text(self.config.model_dump_json())
        log.info("starting %d env workers", len(self.workers))
        await asyncio.gather(*(self._spawn(w) for w in self.workers))
        return envs

    def pids(self) -> list[int]:
        """The live workers' process ids (for measurements)."""
        return [w.proc.pid for w in self.workers if w.proc is not None and w.proc.returncode is None]

    async def _spawn(self, w: Worker) -> None:
        """Start worker `w` and wait until it has loaded the envs."""
        w.generation += 1
        address = f"ipc://{self._dir}/w{w.index}-{w.generation}"
        w.sock = self._ctx.socket(zmq.PAIR)
        w.sock.setsockopt(zmq.LINGER, 0)
        w.sock.bind(address)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))}
        w.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            WORKER_MODULE,
            address,
            str(self._dir / "config.json"),
            str(w.index),
            env=env,
        )
        w.started_at = time.monotonic()
        first = asyncio.ensure_future(w.sock.recv())
        exited = asyncio.ensure_future(w.proc.wait())
        done, _ = await asyncio.wait({first, exited}, return_when=asyncio.FIRST_COMPLETED)
        if first not in done:
            first.cancel()
            raise WorkersFailing(
                f"env worker {w.index} exited with status {w.proc.returncode} while loading the envs "
                "(its log above says why)"
            )
        exited.cancel()
        message = self._decoder.decode(first.result())
        if isinstance(message, Broken):
            await w.proc.wait()
            raise (EnvError if message.needs_user else WorkersFailing)(message.message)
        assert isinstance(message, Ready), message
        w.ready = True
        self._some_ready.set()
        w.reader = self._task(self._read(w), f"env-worker-{w.index}-read")
        self._task(self._watch(w), f"env-worker-{w.index}-watch")

    def _task(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _read(self, w: Worker) -> None:
        sock = w.sock
        while True:
            self._take(w, self._decoder.decode(await sock.recv()))

    def _take(self, w: Worker, message) -> None:
        if isinstance(message, GroupDone):
            entry = w.jobs.pop(message.id, None)
            if entry is not None and not entry[1].done():
                entry[1].set_result(message.rollouts)

    async def _watch(self, w: Worker) -> None:
        """When the worker dies: fail its jobs, and start a new one in its place."""
        code = await w.proc.wait()
        if self._closing:
            return
        w.ready = False
        if not any(x.ready for x in self.workers):
            self._some_ready.clear()
        w.reader.cancel()
        while await w.sock.poll(0):  # what it sent before it died still counts
            self._take(w, self._decoder.decode(await w.sock.recv()))
        w.sock.close()
        lost = list(w.jobs.values())
        w.jobs.clear()
        reason = f"{WORKER_DIED}: env worker {w.index} exited with status {code} while running the group"
        for job, future in lost:
            if not future.done():
                future.set_result(died(job, reason))
        log.warning(
            "env worker %d exited with status %s; %d group(s) it was running failed; starting it again",
            w.index,
            code,
            len(lost),
        )
        w.quick_deaths = w.quick_deaths + 1 if time.monotonic() - w.started_at < QUICK_S else 1
        try:
            if w.quick_deaths >= MAX_QUICK_DEATHS:
                raise WorkersFailing(
                    f"env worker {w.index} died {w.quick_deaths} times within {QUICK_S:.0f} s of starting "
                    f"(last exit status {code}); its log above says why"
                )
            await asyncio.sleep(min(2.0 ** (w.quick_deaths - 1) - 1, 10.0))
            await self._spawn(w)
            self.restarts += 1
        except BaseException as e:
            self._error = e
            self._some_ready.set()  # wake `run` callers, who raise it

    async def close(self) -> None:
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        for w in self.workers:
            if w.proc is not None and w.proc.returncode is None and w.sock is not None:
                try:
                    await w.sock.send(self._encode(Stop()), flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    w.proc.terminate()
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                await asyncio.wait_for(w.proc.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                log.warning("env worker %d did not stop within %.0f s: killing it", w.index, STOP_TIMEOUT_S)
                w.proc.kill()
                await w.proc.wait()
            if w.sock is not None:
                w.sock.close()
        self._ctx.term()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        await self.tasks.close()

    # ---------------------------------------------------------------- jobs

    async def run(self, job: GroupJob) -> list[Rollout]:
        while True:
            if self._error is not None:
                raise self._error
            ready = [w for w in self.workers if w.ready]
            if ready:
                break
            await self._some_ready.wait()
        w = min(ready, key=lambda x: x.inflight)
        future = asyncio.get_running_loop().create_future()
        w.jobs[job.id] = (job, future)
        sock = w.sock
        try:
            await sock.send(self._encode(Job(job)))
        except zmq.ZMQError:
            if sock is w.sock and w.ready:
                raise
            # The worker died while the job was being sent: `_watch` fails its jobs, this one too.
        try:
            return await future
        except asyncio.CancelledError:
            if w.jobs.pop(job.id, None) is not None and w.ready:
                # Best effort: a worker that is gone has nothing to cancel.
                with contextlib.suppress(zmq.ZMQError):
                    sent = w.sock.send(self._encode(Cancel(job.id)), flags=zmq.NOBLOCK)
                    sent.add_done_callback(lambda f: f.cancelled() or f.exception())
            raise


def died(job: GroupJob, reason: str) -> list[Rollout]:
    return [failed_rollout(job.env_name, job.example_id, job.policy_version, reason) for _ in range(job.size)]
