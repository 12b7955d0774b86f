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

    port: int = Field(default=29650, ge=1024, le=65535)
    """Base port: trainer rank r receives on port + r."""

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
