"""The configured transport's two ends: the orchestrator's sender to one trainer rank
(`make_sender`) and that rank's receiver (`make_receiver`)."""

from pathlib import Path

from prime_rl.transport.base import Receiver, Sender
from prime_rl.transport.config import TransportConfig, resolve_run_id
from prime_rl.transport.file_transport import FileReceiver, FileSender
from prime_rl.transport.messages import max_message_bytes
from prime_rl.transport.zmq_transport import ZmqReceiver, ZmqSender, rank_address


def transport_dir(config: TransportConfig, output_dir: Path) -> Path:
    return config.dir if config.dir is not None else Path(output_dir) / "transport"


def make_sender(config: TransportConfig, rank: int, output_dir: Path, seq_len: int | None = None) -> Sender:
    """The orchestrator's sender to one trainer rank; with `seq_len` (the orchestrator's), it
    refuses a message larger than a trainer of that seq_len accepts."""
    if config.type == "zmq":
        address = rank_address(config, rank, resolve_run_id(config, output_dir))
        limit = max_message_bytes(seq_len) if seq_len is not None else None
        return ZmqSender(address, hwm=config.hwm, timeout_s=config.timeout_s, max_message_bytes=limit)
    return FileSender(transport_dir(config, output_dir))


def make_receiver(
    config: TransportConfig,
    run_id: str,
    rank: int,
    output_dir: Path,
    start_step: int = 0,
    seq_len: int | None = None,
) -> Receiver:
    """One trainer rank's receiver; over zmq, with `seq_len` (the trainer's), its socket drops a
    connection that sends a message larger than a micro-batch of that length can be."""
    if config.type == "zmq":
        limit = max_message_bytes(seq_len) if seq_len is not None else None
        return ZmqReceiver(
            rank_address(config, rank, run_id),
            run_id,
            hwm=config.hwm,
            timeout_s=config.timeout_s,
            max_message_bytes=limit,
        )
    return FileReceiver(
        transport_dir(config, output_dir),
        run_id,
        rank=rank,
        start_step=start_step,
        timeout_s=config.timeout_s,
    )
