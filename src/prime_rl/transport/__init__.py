"""Transports: how micro-batches get from the orchestrator to each trainer rank.

`make_sender` / `make_receiver` build the configured transport for one trainer rank.
"""

from pathlib import Path

from prime_rl.transport.base import ForeignRunError, Receiver, Sender, TransportError, TransportTimeout
from prime_rl.transport.config import TransportConfig, resolve_run_id
from prime_rl.transport.file_transport import FileReceiver, FileSender
from prime_rl.transport.zmq_transport import ZmqReceiver, ZmqSender, rank_address


def transport_dir(config: TransportConfig, output_dir: Path) -> Path:
    return config.dir if config.dir is not None else Path(output_dir) / "transport"


def make_sender(config: TransportConfig, rank: int, output_dir: Path) -> Sender:
    """The orchestrator's sender to one trainer rank."""
    if config.type == "zmq":
        address = rank_address(config, rank, resolve_run_id(config, output_dir))
        return ZmqSender(address, hwm=config.hwm, timeout_s=config.timeout_s)
    return FileSender(transport_dir(config, output_dir))


def make_receiver(
    config: TransportConfig, run_id: str, rank: int, output_dir: Path, start_step: int = 0
) -> Receiver:
    """One trainer rank's receiver."""
    if config.type == "zmq":
        return ZmqReceiver(
            rank_address(config, rank, run_id), run_id, hwm=config.hwm, timeout_s=config.timeout_s
        )
    return FileReceiver(
        transport_dir(config, output_dir),
        run_id,
        rank=rank,
        start_step=start_step,
        timeout_s=config.timeout_s,
    )


__all__ = [
    "ForeignRunError",
    "Receiver",
    "Sender",
    "TransportConfig",
    "TransportError",
    "TransportTimeout",
    "make_receiver",
    "make_sender",
]
