"""Transports: round trips, order, back-pressure, slow consumers and foreign runs, over real sockets."""

import threading
import time

import numpy as np
import pytest

from prime_rl.runtime.net import free_port
from prime_rl.transport.base import ForeignRunError, TransportTimeout
from prime_rl.transport.config import TransportConfig, resolve_run_id
from prime_rl.transport.contract import OrchestratorSide
from prime_rl.transport.endpoints import make_receiver, make_sender
from prime_rl.transport.file_transport import FileReceiver, FileSender
from prime_rl.transport.messages import Header, MicroBatch, TrainingBatch, TrainingSample, decode, encode
from prime_rl.transport.zmq_transport import ZmqReceiver, ZmqSender

RUN = "run-a"
SIDE = OrchestratorSide("test", seq_len=1 << 20, trainer_ranks=1)
"""The sender's side of the run contract, which every micro-batch carries."""


def micro_batch(
    step: int, index: int = 0, count: int = 1, n: int = 16, run: str = RUN, rank: int = 0
) -> MicroBatch:
    rng = np.random.default_rng(step * 1000 + index)
    return MicroBatch.from_arrays(
        Header(run, step, rank),
        index,
        count,
        input_ids=rng.integers(0, 512, n),
        position_ids=np.concatenate([np.arange(n // 2), np.arange(n - n // 2)]),
        loss_mask=rng.integers(0, 2, n),
        logprobs=-rng.random(n),
        sample_lens=[n // 2, n - n // 2],
        env_names=["reverse-text", "sum-digits"],
        advantages=rng.standard_normal(2).tolist(),
        token_advantages=rng.standard_normal(n),
        orchestrator=SIDE,
    )


def assert_same(a: MicroBatch, b: MicroBatch) -> None:
    assert a.header == b.header and (a.index, a.count) == (b.index, b.count)
    for key, value in a.arrays().items():
        np.testing.assert_array_equal(value, b.arrays()[key])
    assert (a.sample_lens, a.env_names) == (b.sample_lens, b.env_names)
    assert (a.advantages, a.rewards, a.orchestrator) == (b.advantages, b.rewards, b.orchestrator)


def test_messages_round_trip_through_msgpack():
    mb = micro_batch(3, n=64)
    mb.validate(seq_len=64)
    assert_same(decode(encode(mb)), mb)
    sample = TrainingSample([1, 2], [3, 4, 5], [1, 0, 1], [-0.1, -0.2, -0.3], 0.5, 1.0, "env", 7, 2)
    batch = TrainingBatch(Header(RUN, 1), [sample])
    assert decode(encode(batch)) == batch


def test_micro_batch_validation_names_the_field():
    mb = micro_batch(0, n=16)
    broken = MicroBatch(**{**{f: getattr(mb, f) for f in mb.__struct_fields__}, "logprobs": mb.logprobs[:-8]})
    with pytest.raises(ValueError, match="per-token fields disagree"):
        broken.validate()
    with pytest.raises(ValueError, match="longer than seq_len"):
        mb.validate(seq_len=8)
    with pytest.raises(ValueError, match="equal lengths"):
        TrainingSample([1], [2, 3], [1], [0.0, 0.0], 0.0, 0.0, "env").validate()


@pytest.mark.parametrize("kind", ["zmq", "filesystem"])
def test_round_trip_and_order(kind, tmp_path):
    config = TransportConfig(type=kind, port=free_port(), timeout_s=10)
    sender = make_sender(config, rank=0, output_dir=tmp_path)
    receiver = make_receiver(config, RUN, rank=0, output_dir=tmp_path)
    sent = [micro_batch(step, i, 3) for step in range(4) for i in range(3)]
    for mb in sent:
        sender.send(mb)
    got = [receiver.recv() for _ in sent]
    for a, b in zip(got, sent, strict=True):
        assert_same(a, b)
    sender.close()
    receiver.close()


def test_zmq_back_pressure_bounds_the_queue_and_times_out_clearly():
    address = f"tcp://127.0.0.1:{free_port()}"
    # The timeout also covers the connection being set up before the first send: not too short.
    sender = ZmqSender(address, hwm=2, timeout_s=2.0)
    receiver = ZmqReceiver(address, RUN, hwm=2, timeout_s=5)  # connected but never reading
    big = micro_batch(0, n=250_000)  # ~4 MB each, more than the kernel's socket buffers
    sent = 0
    with pytest.raises(TransportTimeout, match="no trainer took a message"):
        for _ in range(100):
            sender.send(big)
            sent += 1
    assert 0 < sent < 20, f"a stalled consumer should stop the sender after a few messages, not {sent}"
    # Nothing queued was lost: the receiver still gets every accepted message.
    for _ in range(sent):
        assert receiver.recv(timeout_s=5).header.step == 0
    sender.close()
    receiver.close()


def test_zmq_sender_without_a_trainer_times_out_clearly():
    sender = ZmqSender(f"tcp://127.0.0.1:{free_port()}", hwm=1, timeout_s=0.3)
    with pytest.raises(TransportTimeout, match="is the trainer running"):
        for _ in range(5):
            sender.send(micro_batch(0))
    sender.close()


def test_zmq_receiver_without_an_orchestrator_times_out_clearly():
    receiver = ZmqReceiver(f"tcp://127.0.0.1:{free_port()}", RUN, timeout_s=0.2)
    with pytest.raises(TransportTimeout, match="no message from the orchestrator"):
        receiver.recv()
    receiver.close()


def test_zmq_slow_consumer_loses_nothing():
    address = f"tcp://127.0.0.1:{free_port()}"
    sender = ZmqSender(address, hwm=2, timeout_s=30)
    receiver = ZmqReceiver(address, RUN, hwm=2, timeout_s=30)
    n = 60
    got: list[int] = []

    def consume():
        for _ in range(n):
            got.append(receiver.recv().header.step)
            time.sleep(0.005)

    thread = threading.Thread(target=consume)
    thread.start()
    for step in range(n):
        sender.send(micro_batch(step, n=20_000))
    thread.join(timeout=60)
    assert got == list(range(n))
    sender.close()
    receiver.close()


@pytest.mark.parametrize("kind", ["zmq", "filesystem"])
def test_message_from_another_run_is_rejected(kind, tmp_path):
    config = TransportConfig(type=kind, port=free_port(), timeout_s=5)
    sender = make_sender(config, rank=0, output_dir=tmp_path)
    receiver = make_receiver(config, RUN, rank=0, output_dir=tmp_path)
    sender.send(micro_batch(0, run="run-b"))
    with pytest.raises(ForeignRunError, match=r"run 'run-b'.*this is run 'run-a'"):
        receiver.recv()
    sender.close()
    receiver.close()


def test_file_transport_never_exposes_partial_files(tmp_path):
    sender = FileSender(tmp_path)
    receiver = FileReceiver(tmp_path, RUN, timeout_s=5, poll_s=0.001)
    n = 20
    writer = threading.Thread(target=lambda: [sender.send(micro_batch(s, n=50_000)) for s in range(n)])
    writer.start()
    steps = [receiver.recv().header.step for _ in range(n)]  # a partial file would fail to decode
    writer.join()
    assert steps == list(range(n))
    assert not list(tmp_path.rglob("*.tmp"))


def test_file_receiver_can_replay_from_a_later_step(tmp_path):
    sender = FileSender(tmp_path)
    for step in range(3):
        for i in range(2):
            sender.send(micro_batch(step, i, 2))
    receiver = FileReceiver(tmp_path, RUN, start_step=1, timeout_s=1)
    got = [(m.header.step, m.index) for m in (receiver.recv() for _ in range(4))]
    assert got == [(1, 0), (1, 1), (2, 0), (2, 1)]
    with pytest.raises(TransportTimeout):
        receiver.recv(timeout_s=0.05)


SENDER = """
import sys
sys.path.insert(0, {tests!r})
from transport_test import micro_batch
from prime_rl.transport.zmq_transport import ZmqSender
sender = ZmqSender({address!r}, hwm=64, timeout_s=30)
for step in range(20):
    sender.send(micro_batch(step, n=500_000))
sender.close()
"""


def test_zmq_sender_delivers_everything_queued_before_its_process_exits():
    import subprocess
    import sys
    from pathlib import Path

    address = f"tcp://127.0.0.1:{free_port()}"
    receiver = ZmqReceiver(address, RUN, hwm=2, timeout_s=30)
    code = SENDER.format(tests=str(Path(__file__).parent), address=address)
    proc = subprocess.Popen([sys.executable, "-c", code])
    steps = []
    for _ in range(20):
        steps.append(receiver.recv().header.step)
        time.sleep(0.05)  # slower than the sender: most messages are still queued when it exits
    assert proc.wait(timeout=60) == 0
    assert steps == list(range(20))
    receiver.close()


def test_the_default_port_is_the_runs_own_and_both_ends_derive_the_same(tmp_path):
    from prime_rl.transport.config import PORTS_FROM, PORTS_SPAN, resolve_port, resolve_run_id
    from prime_rl.transport.zmq_transport import rank_address

    config = TransportConfig()
    # The orchestrator and the trainer see the same output_dir, so the same run id and port.
    run_a, run_b = resolve_run_id(config, tmp_path / "a"), resolve_run_id(config, tmp_path / "b")
    assert rank_address(config, 1, run_a) == rank_address(TransportConfig(), 1, run_a)
    ports = {resolve_port(config, f"run-{i}") for i in range(50)}
    assert len(ports) > 45 and all(PORTS_FROM <= p < PORTS_FROM + PORTS_SPAN for p in ports)
    assert resolve_port(config, run_a) != resolve_port(config, run_b)  # two runs, two ports
    assert resolve_port(TransportConfig(port=29650), run_a) == 29650  # a port set is kept


def test_two_runs_with_default_transports_on_one_machine_each_get_their_own_data(tmp_path):
    # Before, both bound 127.0.0.1:29650 and the second failed with "Address already in use".
    config = TransportConfig()
    pairs = []
    for name in ("a", "b"):
        out = tmp_path / name
        run_id = resolve_run_id(config, out)
        pairs.append((make_sender(config, 0, out), make_receiver(config, run_id, 0, out), run_id))
    try:
        for sender, _, run_id in pairs:
            sender.send(micro_batch(0, run=run_id))
        for _, receiver, run_id in pairs:
            assert receiver.recv(timeout_s=30).header.run_id == run_id
    finally:
        for sender, receiver, _ in pairs:
            sender.close()
            receiver.close()
