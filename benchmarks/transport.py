"""Transport: micro-batches through msgspec and zmq on loopback, against a plain memory copy.

    uv run python benchmarks/transport.py

A sender thread encodes and pushes N micro-batches of seq_len tokens to a receiver that pulls and
decodes them (and reads their arrays back); the baseline copies the same bytes N times in memory.
Both run in this process, side by side, so the ratio holds on a noisy machine.
"""

from __future__ import annotations

import random
import threading
import time

import numpy as np

from prime_rl.net import free_port
from prime_rl.transport.messages import TrainingSample, encode
from prime_rl.transport.packing import pack
from prime_rl.transport.zmq_transport import ZmqReceiver, ZmqSender

RUN = "bench"


def micro_batch(seq_len: int):
    rng = random.Random(0)
    samples = []
    while sum(len(s) for s in samples) < seq_len * 0.95:
        p, c = rng.randint(50, 300), rng.randint(50, 600)
        samples.append(TrainingSample([rng.randrange(50_000) for _ in range(p)], [rng.randrange(50_000) for _ in range(c)],
                                      [1] * c, [-1.0] * c, 0.5, 1.0, "env"))  # fmt: skip
    return pack(samples[:-1], seq_len, 1, RUN, 0)[0][0]


def through_zmq(mb, n: int) -> float:
    address = f"tcp://127.0.0.1:{free_port()}"
    sender = ZmqSender(address, hwm=16)
    receiver = ZmqReceiver(address, RUN, hwm=16)

    def push():
        for _ in range(n):
            sender.send(mb)

    t0 = time.perf_counter()
    thread = threading.Thread(target=push)
    thread.start()
    for _ in range(n):
        got = receiver.recv(timeout_s=60)
        got.arrays()  # the trainer reads the arrays back
    thread.join()
    elapsed = time.perf_counter() - t0
    sender.close()
    receiver.close()
    return elapsed


def memory_copy(data: bytes, n: int) -> float:
    src = np.frombuffer(data, dtype=np.uint8)
    t0 = time.perf_counter()
    for _ in range(n):
        src.copy()
    return time.perf_counter() - t0


def main() -> None:
    print(
        f"{'seq_len':>8}{'MB/msg':>8}{'msgs':>6}{'zmq MB/s':>10}{'memcpy MB/s':>13}{'ratio':>8}{'msgs/s':>8}"
    )
    for seq_len, n in ((2048, 400), (8192, 200), (32768, 50)):
        mb = micro_batch(seq_len)
        size = len(encode(mb)) / 2**20
        through_zmq(mb, 5)  # warm up the sockets
        t_zmq = through_zmq(mb, n)
        t_copy = memory_copy(encode(mb), n)
        print(f"{seq_len:>8}{size:>8.2f}{n:>6}{size * n / t_zmq:>10.0f}{size * n / t_copy:>13.0f}"
              f"{t_copy / t_zmq:>8.3f}{n / t_zmq:>8.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
