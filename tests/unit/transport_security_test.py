"""The zmq transport against a neighbour on the network, over real sockets: with a run secret, a
process without it takes no micro-batch from the orchestrator and hands the trainer none; every
micro-batch carries the run contract; the trainer's socket bounds a message's size."""

import asyncio
import contextlib
import logging
import threading
import time

import msgspec
import pytest
import zmq
from transport_test import RUN, assert_same, micro_batch

from prime_rl.runtime import secret
from prime_rl.runtime.net import free_port
from prime_rl.trainer.data import StepReceiver
from prime_rl.transport.base import NoContract, TransportError, TransportTimeout
from prime_rl.transport.config import TransportConfig
from prime_rl.transport.contract import TrainerSide
from prime_rl.transport.curve import run_keys
from prime_rl.transport.endpoints import make_receiver
from prime_rl.transport.file_transport import FileReceiver, FileSender
from prime_rl.transport.messages import BYTES_PER_TOKEN_BOUND, Header, MicroBatch, encode, max_message_bytes
from prime_rl.transport.zmq_transport import AsyncZmqSender, ZmqReceiver, ZmqSender

N = 12


@pytest.fixture(params=["no secret", "secret"])
def either(request, monkeypatch):
    """Without a run secret, then with one (plain sockets, then CURVE)."""
    monkeypatch.delenv(secret.FILE_ENV, raising=False)
    if request.param == "secret":
        monkeypatch.setenv(secret.ENV, "the-secret-of-this-run")
    else:
        monkeypatch.delenv(secret.ENV, raising=False)
    secret.value.cache_clear()
    yield
    secret.value.cache_clear()


@pytest.fixture
def context():
    """The intruder's own zmq context."""
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


def refusal_lines(caplog, address: str) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if "refused" in r.getMessage() and address in r.getMessage()
    ]


def intruder_pull(ctx: zmq.Context, address: str, keys: str) -> zmq.Socket:
    """A PULL socket a neighbour connects to the orchestrator's address: with no keys, or with CURVE
    and the run's server key (the worst case: it learned it) but a client key of its own."""
    sock = ctx.socket(zmq.PULL)
    sock.linger = 0
    if keys == "wrong client key":
        public, secret_key = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
            run_keys().server_public,
            public,
            secret_key,
        )
    sock.connect(address)
    return sock


@pytest.mark.parametrize("keys", ["none", "wrong client key"])
def test_an_intruder_pulling_from_the_orchestrator_gets_nothing_and_the_trainer_gets_everything(
    run_secret, context, caplog, keys
):
    caplog.set_level(logging.WARNING, logger="prime_rl.transport")
    address = f"tcp://127.0.0.1:{free_port()}"
    sender = ZmqSender(address, hwm=4, timeout_s=10)
    try:
        intruder = intruder_pull(context, address, keys)
        # Without CURVE the intruder is a peer like any other and takes every other micro-batch.
        wait_for(lambda: refusal_lines(caplog, address), "the intruder's connection to be refused")
        receiver = ZmqReceiver(address, RUN, hwm=4, timeout_s=10)
        sent = [micro_batch(step) for step in range(N)]
        for mb in sent:
            sender.send(mb)
        for mb in sent:
            assert_same(receiver.recv(), mb)
        with pytest.raises(TransportTimeout):
            receiver.recv(timeout_s=0.2)  # nothing twice
        assert intruder.poll(0) == 0
        (line,) = refusal_lines(caplog, address)  # one line, however often it tried
        assert line.startswith(
            f"refused 1 connection(s) to {address} from a process without this run's secret"
        )
        assert secret.ENV in line and "\n" not in line
        receiver.close()
    finally:
        sender.close(linger_s=0)


def test_the_orchestrators_async_sender_refuses_an_intruder_too(run_secret, context, caplog):
    caplog.set_level(logging.WARNING, logger="prime_rl.transport")
    address = f"tcp://127.0.0.1:{free_port()}"
    sent = [micro_batch(step) for step in range(N)]
    receiver = ZmqReceiver(address, RUN, hwm=4, timeout_s=10)

    async def orchestrator() -> list[MicroBatch]:
        sender = AsyncZmqSender(address, hwm=4, timeout_s=10)
        try:
            intruder = intruder_pull(context, address, "none")
            while not refusal_lines(caplog, address):  # (the event loop runs on meanwhile)
                await asyncio.sleep(0.02)

            async def send_all() -> None:
                for mb in sent:
                    await sender.send(mb)

            got, _ = await asyncio.gather(
                asyncio.to_thread(lambda: [receiver.recv() for _ in sent]), send_all()
            )
            assert intruder.poll(0) == 0
            return got
        finally:
            await asyncio.to_thread(sender.close, 0)

    try:
        got = asyncio.run(asyncio.wait_for(orchestrator(), 120))  # only a hang guard
    finally:
        receiver.close()
    for a, b in zip(got, sent, strict=True):
        assert_same(a, b)


def test_a_flood_of_refused_connections_is_one_line_then_a_count(run_secret, context, caplog):
    caplog.set_level(logging.WARNING, logger="prime_rl.transport")
    address = f"tcp://127.0.0.1:{free_port()}"
    sender = ZmqSender(address, timeout_s=10)
    try:
        for _ in range(20):
            intruder_pull(context, address, "none")
        wait_for(lambda: sender.refusals.total >= 20, "20 refused connections")
        assert len(refusal_lines(caplog, address)) == 1
    finally:
        sender.close(linger_s=0)
    # What the rate limit held back is counted on close.
    assert refusal_lines(caplog, address)[1].startswith(
        f"refused {sender.refusals.total - 1} connection(s) to"
    )


@pytest.mark.parametrize("intruder", ["plain", "own keys"])
def test_an_intruder_that_binds_the_port_first_feeds_the_trainer_nothing(
    run_secret, context, caplog, intruder
):
    caplog.set_level(logging.WARNING, logger="prime_rl.transport")
    address = f"tcp://127.0.0.1:{free_port()}"
    push = context.socket(zmq.PUSH)  # bound before the orchestrator, by a process without the secret
    push.linger = 0
    if intruder == "own keys":
        push.curve_server, push.curve_secretkey = True, zmq.curve_keypair()[1]
    push.bind(address)
    receiver = ZmqReceiver(address, RUN, timeout_s=10)
    # Refused at every reconnection (zmq's for an intruder with keys of its own, the receiver's a
    # second later for a plain one, whom zmq gives up on): one line all the same.
    refusals = 3
    pushed = 0
    try:
        deadline = time.monotonic() + 60  # a few seconds here; only a hang guard
        while receiver.refusals.total < refusals:
            assert time.monotonic() < deadline, f"{receiver.refusals.total} refusals after 60 s"
            with contextlib.suppress(zmq.Again):  # (it goes as soon as the intruder has a peer)
                push.send(encode(micro_batch(0)), zmq.NOBLOCK)
                pushed += 1
            with pytest.raises(TransportTimeout):
                receiver.recv(timeout_s=0.2)  # (it reads its socket's monitor while it waits)
        assert pushed == 0  # the trainer never became the intruder's peer
        (line,) = refusal_lines(caplog, address)
        assert line.startswith(
            f"refused 1 connection(s) to {address}: the process there does not hold this run's secret"
        )
        assert "another process using this port" in line and "\n" not in line
    finally:
        receiver.close()


def test_the_trainer_finds_the_orchestrator_once_a_squatter_has_left_its_port(run_secret):
    address = f"tcp://127.0.0.1:{free_port()}"
    squatter = zmq.Context()
    push = squatter.socket(zmq.PUSH)  # plain: the trainer's zmq socket gives up on its address
    push.linger = 0
    push.bind(address)
    receiver = ZmqReceiver(address, RUN, timeout_s=10)
    try:
        while not receiver.refusals.total:
            with pytest.raises(TransportTimeout):
                receiver.recv(timeout_s=0.2)
        squatter.destroy(linger=0)  # (returns once its port is free)
        sender = ZmqSender(address, timeout_s=10)
        orchestrator = threading.Thread(target=sender.send, args=(micro_batch(7),))  # (waits for a peer)
        orchestrator.start()
        try:
            assert receiver.recv(timeout_s=10).header.step == 7  # (it connects again while it waits)
        finally:
            orchestrator.join()
            sender.close(linger_s=0)
    finally:
        receiver.close()


@pytest.mark.parametrize("kind", ["zmq", "filesystem"])
def test_a_micro_batch_without_the_orchestrators_contract_is_refused_in_one_line(kind, tmp_path):
    if kind == "zmq":
        address = f"tcp://127.0.0.1:{free_port()}"
        sender, receiver = ZmqSender(address, timeout_s=10), ZmqReceiver(address, RUN, timeout_s=10)
    else:
        sender, receiver = FileSender(tmp_path), FileReceiver(tmp_path, RUN, timeout_s=10)
        address = str(tmp_path)
    sender.send(msgspec.structs.replace(micro_batch(0), orchestrator=None))
    try:
        with pytest.raises(NoContract) as e:
            StepReceiver(receiver, seq_len=128, side=TrainerSide(seq_len=128, dp=1)).get(0)
        text = str(e.value)
        assert text.startswith("micro-batch 0 of step 0 (rank 0) from ") and address in text, text
        assert "carries no orchestrator side of the run contract" in text and "\n" not in text
    finally:
        sender.close()
        receiver.close()


def test_a_message_over_the_trainers_limit_never_reaches_it(either, tmp_path):
    config = TransportConfig(port=free_port(), timeout_s=10)
    # A trainer of seq_len 1024 takes messages up to the floor (16 MiB); a sender that does not check
    # (not the orchestrator) sends a larger one after a small one.
    receiver = make_receiver(config, RUN, 0, tmp_path, seq_len=1024)
    sender = ZmqSender(receiver.address, timeout_s=10)
    big = micro_batch(1, n=1_100_000)
    assert len(encode(big)) > max_message_bytes(1024)
    try:
        sender.send(micro_batch(0))
        assert receiver.recv().header.step == 0
        sender.send(big)  # queued on the connection that carried step 0
        with pytest.raises(TransportTimeout):  # zmq dropped the connection at the big one's header
            receiver.recv(timeout_s=2)  # (loopback carries it in a fraction of that)
    finally:
        sender.close(linger_s=0)
        receiver.close()


def test_a_message_of_the_limit_itself_reaches_the_trainer(either):
    """(With CURVE, zmq's limit counts CURVE's framing too.)"""
    address, mb = f"tcp://127.0.0.1:{free_port()}", micro_batch(0, n=4096)
    limit = len(encode(mb))
    sender = ZmqSender(address, timeout_s=10, max_message_bytes=limit)
    receiver = ZmqReceiver(address, RUN, timeout_s=10, max_message_bytes=limit)
    try:
        sender.send(mb)
        assert_same(receiver.recv(), mb)
    finally:
        sender.close(linger_s=0)
        receiver.close()


def test_the_orchestrator_refuses_to_send_what_the_trainer_would_drop():
    address = f"tcp://127.0.0.1:{free_port()}"
    sender = ZmqSender(address, timeout_s=10, max_message_bytes=max_message_bytes(1024))
    try:
        with pytest.raises(
            TransportError, match=r"^micro-batch 0 of step 1 \(rank 0\) for .* encodes to \d+ bytes"
        ):
            sender.send(micro_batch(1, n=1_100_000))
    finally:
        sender.close(linger_s=0)


def test_the_size_bound_holds_the_largest_micro_batch_there_is():
    """Per token, the most a micro-batch carries: every field, routes of 2-byte expert ids over 100
    layers x top-10, and a sample (with a long env name) per token."""
    import numpy as np

    n = 4096
    ones = np.ones(n)
    mb = MicroBatch.from_arrays(
        Header(RUN, 0), 0, 1, ones, ones, ones, ones, [1] * n, ["an-env-with-a-rather-long-name" * 2] * n,
        advantages=[0.1] * n, rewards=[0.3] * n, token_advantages=ones,
        routes=np.ones((n, 100, 10), dtype="<u2"),
    )  # fmt: skip
    assert len(encode(mb)) < n * BYTES_PER_TOKEN_BOUND / 3


def test_receivers_made_one_after_another_in_one_process_each_watch_their_own_socket():
    # (Each has a monitor on an inproc name; a name taken from the socket's id() was reused by the
    # next receiver while the last one's monitor still held it.)
    address = f"tcp://127.0.0.1:{free_port()}"
    for _ in range(50):
        ZmqReceiver(address, RUN).close()


def test_without_a_secret_both_ends_are_plain_sockets_as_before(no_secret, context):
    assert run_keys() is None
    address = f"tcp://127.0.0.1:{free_port()}"
    sender = ZmqSender(address, timeout_s=10)
    plain = context.socket(zmq.PULL)  # a socket with no keys takes the orchestrator's messages
    plain.linger = 0
    plain.connect(address)
    try:
        sender.send(micro_batch(0))
        assert plain.poll(10_000) and plain.recv()
    finally:
        sender.close(linger_s=0)
    address = f"tcp://127.0.0.1:{free_port()}"
    push = context.socket(zmq.PUSH)  # and the trainer takes a plain socket's
    push.linger = 0
    push.bind(address)
    receiver = ZmqReceiver(address, RUN, timeout_s=10)
    try:
        push.send(encode(micro_batch(1)))
        assert receiver.recv().header.step == 1
    finally:
        receiver.close()
