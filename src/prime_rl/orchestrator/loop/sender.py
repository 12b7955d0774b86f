"""Stream each trainer rank its micro-batches: over zmq (async, back-pressured by the high-water
mark) or through the filesystem transport (in a worker thread, off the event loop).

Over zmq each rank first gets a `Hello` (the run contract), sent as soon as the rank connects; the
filesystem transport has none: its micro-batches carry the contract as every micro-batch does."""

from __future__ import annotations

import asyncio

from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.transport.config import resolve_run_id
from prime_rl.transport.contract import OrchestratorSide
from prime_rl.transport.endpoints import transport_dir
from prime_rl.transport.file_transport import FileSender
from prime_rl.transport.messages import Header, Hello, MicroBatch, max_message_bytes
from prime_rl.transport.zmq_transport import AsyncZmqSender, rank_address


class BatchSender:
    """Sends each rank its micro-batches, over zmq (async) or the filesystem (in a thread)."""

    def __init__(self, config: OrchestratorConfig):
        t = config.transport
        if t.type == "zmq":
            run_id = resolve_run_id(t, config.output_dir)
            self._zmq = [
                AsyncZmqSender(
                    rank_address(t, r, run_id),
                    hwm=t.hwm,
                    timeout_s=t.timeout_s,
                    # (the trainer's limit is at least this: its seq_len is at least ours, by contract)
                    max_message_bytes=max_message_bytes(config.seq_len),
                )
                for r in range(config.trainer_ranks)
            ]
            self._files = None
        else:
            self._zmq = None
            self._files = FileSender(transport_dir(t, config.output_dir))
        self._hellos: list[asyncio.Task] = []

    def hello(self, run_id: str, side: OrchestratorSide) -> None:
        """Greet every rank as it connects (in the background: a trainer may start much later)."""
        for r, sender in enumerate(self._zmq or []):
            message = Hello(Header(run_id, -1, r), side)
            self._hellos.append(asyncio.create_task(sender.send_when_connected(message), name=f"hello-{r}"))

    async def send(self, per_rank: list[list[MicroBatch]]) -> None:
        if self._zmq is not None:
            await asyncio.gather(
                *(self._send_rank(sender, mbs) for sender, mbs in zip(self._zmq, per_rank, strict=True))
            )
        else:
            await asyncio.to_thread(lambda: [self._files.send(mb) for mbs in per_rank for mb in mbs])

    @staticmethod
    async def _send_rank(sender: AsyncZmqSender, mbs: list[MicroBatch]) -> None:
        for mb in mbs:
            await sender.send(mb)

    async def close(self, deliver: bool) -> None:
        """Close the sockets; with `deliver`, first wait (up to the timeout) for queued micro-batches."""
        for task in self._hellos:
            task.cancel()
        zmq, self._zmq = self._zmq, []  # closing twice (after a failed start) is a no-op
        for s in zmq or []:
            await asyncio.to_thread(s.close, None if deliver else 0.0)
