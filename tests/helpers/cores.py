"""Which cores this xdist worker's `rl` runs and vLLM servers use.

`rl` on a CPU build gives vLLM's spinning threads the first half of the cores and the trainer the
rest. Two `rl` runs on two workers would then put both vLLMs (and both orchestrators) on the same
half and leave the other mostly idle: measured on 2 cores, two concurrent 8-step runs took 96 s
each that way and 61 s with the second run mirrored. So odd workers take the mirror image.
"""

import os


def worker_cores() -> tuple[list[int], list[int]] | None:
    """(inference cores, trainer cores) for this worker; None without xdist or with one core, where
    `rl`'s own default is right."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cpus = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or len(cpus) < 2:
        return None
    half = len(cpus) // 2
    first, second = cpus[:half], cpus[half:]
    return (first, second) if int(worker[2:]) % 2 == 0 else (second, first)


def deployment_keys() -> str:
    """`[deployment]` keys that place an `rl` run on this worker's cores ("" where the default is right)."""
    cores = worker_cores()
    return "" if cores is None else f"inference_cpus = {cores[0]}\ntrainer_cpus = {cores[1]}\n"


def server_env() -> dict[str, str]:
    """The environment for a vLLM server a test starts itself: its compute threads on this worker's
    inference cores (vLLM's own choice is always the first core)."""
    cores = worker_cores()
    env = dict(os.environ)
    if cores is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores[0]))
    return env
