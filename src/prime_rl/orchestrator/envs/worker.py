"""An env worker: one process that loads the envs and runs the groups the loop sends it.

    python -m prime_rl.orchestrator.envs.worker <address> <config.json> <index>

It connects a zmq PAIR socket to the loop's `address`, answers `Ready` once its envs are loaded (or
`Broken` with the one-line reason, then exits 2 for a user error), and then runs each `Job` as a
task of its own event loop, answering `GroupDone` with the job's rollouts. `Cancel` stops a job
without an answer; `Stop`, or the loop's process going away, tears the envs down and exits.
Invariant: every job it takes is answered once, or cancelled by the loop; the loop counts the jobs
of a worker that dies as failed (`loop/workers.py`).
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import signal
import sys
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from prime_rl.environments import EnvError
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.messages import Broken, Cancel, GroupDone, Job, Ready, Stop, ToWorker
from prime_rl.runtime import activity
from prime_rl.runtime.imports import heavy_imports
from prime_rl.runtime.logging_setup import setup_logging
from prime_rl.sandbox.tools_host import slow_call

log = logging.getLogger("prime_rl.orchestrator")

PARENT_POLL_S = 1.0
"""How often to look whether the loop's process is gone (when the kernel cannot tell us)."""


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (a killed orchestrator leaves no
    workers behind); elsewhere the parent poll in `serve` does it, a little later."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


async def serve(address: str, config: OrchestratorConfig) -> None:
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(ToWorker)
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    parent = os.getppid()
    with heavy_imports():  # the env side: verifiers, the envs' modules (seconds of CPU)
        from prime_rl.orchestrator.envs.local import LocalEnvs
    envs = LocalEnvs(config)
    try:
        await envs.start()
    except EnvError as e:
        await sock.send(encoder.encode(Broken(str(e), needs_user=True)))
        raise
    except Exception as e:
        await sock.send(encoder.encode(Broken(f"{type(e).__name__}: {e}", needs_user=False)))
        raise
    # As in the orchestrator: keep the garbage collector from walking the loaded modules and datasets
    # again in every full collection.
    gc.collect()
    gc.freeze()
    await sock.send(encoder.encode(Ready(os.getpid())))
    running: dict[int, asyncio.Task] = {}
    beats = asyncio.create_task(activity.beat_loop(), name="activity-beat")

    def say() -> None:
        if running and (slow := slow_call()):
            activity.doing(f"running {len(running)} group(s), waiting on {slow}", "sandbox")
        elif running:
            activity.doing(f"running {len(running)} group(s)", "inference")
        else:
            activity.doing("waiting for groups", "orchestrator")

    async def run(job) -> None:
        try:
            rollouts = await envs.run(job)
        finally:
            running.pop(job.id, None)
            say()
        await sock.send(encoder.encode(GroupDone(job.id, rollouts)))

    say()

    try:
        while True:
            if not await sock.poll(PARENT_POLL_S * 1000):
                if os.getppid() != parent:
                    log.info("the orchestrator is gone: stopping")
                    return
                say()  # a sandboxed call turned slow since
                continue
            message = decoder.decode(await sock.recv())
            if isinstance(message, Job):
                running[message.job.id] = asyncio.create_task(
                    run(message.job), name=f"group-{message.job.id}"
                )
                say()
            elif isinstance(message, Cancel):
                task = running.pop(message.id, None)
                if task is not None:
                    task.cancel()
            elif isinstance(message, Stop):
                return
    finally:
        beats.cancel()
        for task in running.values():
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)
        await envs.close()
        sock.close(linger=0)
        ctx.term()


def main() -> None:
    address, config_path, index = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    die_with_parent()
    setup_logging(f"env-worker-{index}")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config = OrchestratorConfig.model_validate_json(config_path.read_text())
    activity.start(f"env-worker-{index}", "env-worker", config.output_dir, doing="loading the envs")
    try:
        asyncio.run(serve(address, config))
    except EnvError:
        raise SystemExit(2) from None  # the loop shows the reason (`Broken`)
    except KeyboardInterrupt:
        raise SystemExit(128 + signal.SIGINT) from None


if __name__ == "__main__":
    main()
