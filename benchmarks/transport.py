"""Transport: micro-batches through msgspec and zmq on loopback, against a plain memory copy, and
with CURVE (a run secret) against without.

    uv run python benchmarks/transport.py [--rounds 5]

A sender thread encodes and pushes N micro-batches of seq_len tokens to a receiver that pulls and
decodes them (and reads their arrays back); the baseline copies the same bytes N times in memory.
Both run in this process, side by side, so the ratio holds on a noisy machine.

CURVE vs plain streams the same micro-batches both ways, alternating over `--rounds` (the best
round of each counts), and reports the wall time (the raw cost of encryption when the trainer waits
on the transport) and the CPU time of the receiving thread (what the trainer's own thread spends:
zmq encrypts and decrypts in its I/O threads, beside it) and of the whole process.
"""

from __future__ import annotations

import argparse
import os
import random
import threading
import time

import numpy as np

from prime_rl.runtime import secret
from prime_rl.runtime.net import free_port
from prime_rl.transport.contract import OrchestratorSide
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
    return pack(samples[:-1], seq_len, 1, RUN, 0, orchestrator=OrchestratorSide("bench", seq_len, 1))[0][0]


def sockets(curve: bool) -> tuple[ZmqSender, ZmqReceiver]:
    """A sender and a receiver on one address, with CURVE or without (keys are read as they are made)."""
    address = f"tcp://127.0.0.1:{free_port()}"
    if curve:
        os.environ[secret.ENV] = "benchmark"
    secret.value.cache_clear()
    try:
        return ZmqSender(address, hwm=16), ZmqReceiver(address, RUN, hwm=16)
    finally:
        os.environ.pop(secret.ENV, None)
        secret.value.cache_clear()


def through_zmq(mb, n: int, curve: bool = False) -> tuple[float, float, float]:
    """Wall seconds, the receiving thread's CPU seconds and the process's CPU seconds for `n`."""
    sender, receiver = sockets(curve)

    def push():
        for _ in range(n):
            sender.send(mb)

    sender.send(mb)  # connected (with CURVE: handshake done) before the clock starts
    receiver.recv(timeout_s=60)
    t0, cpu0, thread0 = time.perf_counter(), time.process_time(), time.thread_time()
    thread = threading.Thread(target=push)
    thread.start()
    for _ in range(n):
        got = receiver.recv(timeout_s=60)
        got.arrays()  # the trainer reads the arrays back
    thread_cpu = time.thread_time() - thread0
    thread.join()
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    sender.close()
    receiver.close()
    return elapsed, thread_cpu, cpu


def memory_copy(data: bytes, n: int) -> float:
    src = np.frombuffer(data, dtype=np.uint8)
    t0 = time.perf_counter()
    for _ in range(n):
        src.copy()
    return time.perf_counter() - t0


CASES = ((2048, 400), (8192, 200), (32768, 50))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="CURVE and plain runs, alternating")
    args = ap.parse_args()
    for name in (secret.ENV, secret.FILE_ENV):  # plain means plain: `sockets` sets the secret for CURVE
        os.environ.pop(name, None)
    print(
        f"{'seq_len':>8}{'MB/msg':>8}{'msgs':>6}{'zmq MB/s':>10}{'memcpy MB/s':>13}{'ratio':>8}{'msgs/s':>8}"
    )
    for seq_len, n in CASES:
        mb = micro_batch(seq_len)
        size = len(encode(mb)) / 2**20
        through_zmq(mb, 5)  # warm up the sockets
        t_zmq, _, _ = through_zmq(mb, n)
        t_copy = memory_copy(encode(mb), n)
        print(f"{seq_len:>8}{size:>8.2f}{n:>6}{size * n / t_zmq:>10.0f}{size * n / t_copy:>13.0f}"
              f"{t_copy / t_zmq:>8.3f}{n / t_zmq:>8.0f}")  # fmt: skip

    print(f"\nCURVE vs plain, best of {args.rounds} rounds each; ms per million tokens: wall (the trainer")
    print("waits for the transport), the receiving thread's CPU (it does not: the trainer's own thread)")
    print(f"{'seq_len':>8}{'plain MB/s':>12}{'CURVE MB/s':>12}{'wall x':>8}{'wall ms/Mtok':>16}"
          f"{'recv CPU ms/Mtok':>20}{'proc CPU x':>12}")  # fmt: skip
    for seq_len, _ in CASES:
        mb = micro_batch(seq_len)
        size = len(encode(mb)) / 2**20
        n = int(256 / size)  # 256 MB a run: long enough to time
        per_mtok = 1e9 / (mb.num_tokens * n)  # seconds of the run -> ms per million tokens
        best = {}
        for _ in range(args.rounds):
            for curve in (False, True):
                got = through_zmq(mb, n, curve)
                best[curve] = [min(a, b) for a, b in zip(best.get(curve, got), got, strict=True)]
        (plain, plain_thread, plain_cpu), (cw, cw_thread, cw_cpu) = best[False], best[True]
        wall = f"{plain * per_mtok:.1f} -> {cw * per_mtok:.1f}"
        thread = f"{plain_thread * per_mtok:.1f} -> {cw_thread * per_mtok:.1f}"
        print(f"{seq_len:>8}{size * n / plain:>12.0f}{size * n / cw:>12.0f}{cw / plain:>8.3f}{wall:>16}"
              f"{thread:>20}{cw_cpu / plain_cpu:>12.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
