"""What a sandbox may use: its limits, its network and the paths it may read."""

from __future__ import annotations

from pydantic import Field

from prime_rl.config import BaseConfig


class SandboxConfig(BaseConfig):
    """A sandbox for what an env runs on the model's behalf (code, commands, tools)."""

    timeout_s: float = Field(default=10.0, gt=0)
    """Wall-clock deadline of one run: past it, every process of the sandbox is killed."""

    cpu_s: int = Field(default=10, ge=1)
    """CPU seconds one run may use (RLIMIT_CPU)."""

    memory_mb: int = Field(default=1024, ge=16)
    """Address space of each process (RLIMIT_AS): Python alone maps about 30 MB."""

    processes: int = Field(default=32, ge=1)
    """Processes and threads the sandbox's user may have at once (RLIMIT_NPROC): a fork bomb stops
    there."""

    file_mb: int = Field(default=64, ge=1)
    """Largest file it may write (RLIMIT_FSIZE)."""

    output_kb: int = Field(default=256, ge=1)
    """Stdout and stderr it may print, each: past it, the run is killed."""

    network: bool = False
    """Whether it shares the machine's network. Off: its own network namespace, with nothing in it
    but its own loopback (the run's ports on 127.0.0.1 cannot be reached)."""

    read_only: list[str] = []
    """More paths it may read (the Python it runs, its packages and the env's own are added)."""
