"""What a sandbox may use: its limits, its network and the paths it may read."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from prime_rl.config import BaseConfig


class SandboxConfig(BaseConfig):
    """A sandbox for what an env runs on the model's behalf (code, commands, tools)."""

    runtime: Literal["bubblewrap", "none"] = "bubblewrap"
    """`bubblewrap`: a local sandbox (no daemon, image or network needed). `none`: tools run in the
    env worker's own process with the run's full rights (an explicit opt-in for machines that cannot
    sandbox; the run logs it at start)."""

    timeout_s: float = Field(default=10.0, gt=0)
    """Wall-clock deadline of one run (of one tool call): past it, every process it started is
    killed and the call fails."""

    cpu_s: int = Field(default=10, ge=1)
    """CPU seconds one run (one rollout's tool session) may use (RLIMIT_CPU)."""

    memory_mb: int = Field(default=1024, ge=16)
    """Address space of each process (RLIMIT_AS): Python alone maps about 30 MB."""

    processes: int = Field(default=32, ge=1)
    """Processes and threads the sandbox's user may have at once (RLIMIT_NPROC): a fork bomb stops
    there."""

    file_mb: int = Field(default=64, ge=1)
    """Largest file it may write (RLIMIT_FSIZE)."""

    output_kb: int = Field(default=256, ge=1)
    """Stdout and stderr a one-shot run may print, each: past it, the run is killed. A tool's result
    (as JSON) may be this long: a longer one fails its call."""

    network: bool = False
    """Whether it shares the machine's network. Off: its own network namespace, with nothing in it
    but its own loopback (the run's ports on 127.0.0.1 cannot be reached)."""

    parallel_calls: int = Field(default=16, ge=1)
    """Tool calls that run at once in the env's tool host (per env worker); the others wait their
    turn, their deadline not yet running. A bound on what a step's calls take from the trainer and
    the engine at once (code-add on 2 cores: 2 gave 8.6 s a step, 16 gave 7.7 s, no bound 8.6 s)."""

    sessions_per_worker: int = Field(default=64, ge=1)
    """Rollouts a warm tool worker serves in turn (each with its own tools and scratch folder)
    before a fresh one replaces it. 1: a fresh process per rollout, so not even a module's global
    outlives it (forking one costs about 5 ms of CPU for an env that imports verifiers)."""

    read_only: list[str] = []
    """More paths it may read (the Python it runs, its packages and the env's own are added)."""
