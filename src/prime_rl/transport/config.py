"""How training data travels from the orchestrator to the trainer."""

from pathlib import Path
from typing import Literal

from pydantic import Field

from prime_rl.config import BaseConfig


class TransportConfig(BaseConfig):
    """Transport of micro-batches from the orchestrator to the trainer ranks."""

    type: Literal["zmq", "filesystem"] = "zmq"
    """'zmq' streams over PUSH/PULL sockets; 'filesystem' writes files (debugging, replays)."""

    host: str = "127.0.0.1"
    """Address the orchestrator binds and the trainer connects to (loopback unless you need otherwise)."""

    port: int | None = Field(default=None, ge=1024, le=65535)
    """Base port: trainer rank r receives on port + r. Unset: one derived from the run id, between
    20000 and 31999 (below Linux's ephemeral ports), so that the two ends of a run, which share its
    run id, agree, and two runs on one machine do not fight over one port. Set it where a firewall
    must know it."""

    hwm: int = Field(default=16, ge=1)
    """High-water mark: messages queued per socket before a send waits (back-pressure)."""

    timeout_s: float = Field(default=600.0, gt=0)
    """Seconds a send or receive waits for the peer before failing with a clear error."""

    dir: Path | None = None
    """Folder of the filesystem transport; defaults to <output_dir>/transport."""

    run_id: str | None = None
    """Stamped on every message and checked by the receiver; defaults to a hash of the output folder."""


def resolve_run_id(config: TransportConfig, output_dir: Path) -> str:
    """The run id both ends derive from the same config (set it explicitly across machines)."""
    if config.run_id:
        return config.run_id
    import hashlib

    path = str(Path(output_dir).resolve())
    return f"{Path(path).name}-{hashlib.sha1(path.encode()).hexdigest()[:8]}"


PORTS_FROM = 20000
PORTS_SPAN = 12000
"""Derived base ports lie in [PORTS_FROM, PORTS_FROM + PORTS_SPAN): below the ephemeral range
(32768-60999), which the OS hands out to outgoing connections, with room for ranks above them."""


def resolve_port(config: TransportConfig, run_id: str) -> int:
    """The base port of the run `run_id`: `config.port`, or one derived from the run id."""
    if config.port is not None:
        return config.port
    import hashlib

    return PORTS_FROM + int.from_bytes(hashlib.sha1(run_id.encode()).digest()[:4], "big") % PORTS_SPAN
