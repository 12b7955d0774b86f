"""The weight broadcast's rendezvous store against a neighbour on the same host: the review's hijack
(read the update's keys, join as rank 0, send) finds nothing to read or join, a squatter on the
store's port learns nothing, and the trainer's weights arrive."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from prime_rl.auth import store as store_module
from prime_rl.auth.store import HELLO, NONCE_BYTES, RemoteStore, StoreRefused, StoreServer
from prime_rl.runtime.net import free_port
from prime_rl.transport.weight_transfer import (
    Unsealed,
    join_group,
    make_plan,
    plan_from_json,
    plan_to_json,
    receive,
    seal_key,
    send,
)


@pytest.fixture
def trainer_store(run_secret):
    server = StoreServer("127.0.0.1", free_port(), timeout_s=30)
    yield server
    server.close()


def test_a_neighbour_can_neither_read_nor_join_and_the_server_gets_the_trainers_weights(trainer_store):
    port, prefix = trainer_store.address[1], "prime_rl/step_1/00ff/"
    state = {"w": torch.arange(6, dtype=torch.float32)}
    plan = make_plan(state, 1 << 20)
    got = {}

    def server_worker() -> None:  # what a vLLM worker does on `receive_weights`
        group = join_group(RemoteStore("127.0.0.1", port, 30), prefix, 1, 2, 30, cuda=False)
        got.update(
            (n, t.clone()) for n, t in receive(group, plan_from_json(plan_to_json(plan)), torch.device("cpu"))
        )

    worker = threading.Thread(target=server_worker)
    worker.start()
    trainer_store.table.wait([f"{prefix}/0/1"], 30)  # the update is forming: the review's moment to strike
    # The review's attack: torch's store client, to list the keys and find the update's prefix.
    with pytest.raises(Exception):  # noqa: B017 (torch raises its own kinds of errors)
        dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2), wait_for_workers=False
        ).list_keys()
    # Our own client without the run's key: refused before it can read, write or wait on anything.
    with pytest.raises(StoreRefused, match="not this run's trainer's"):
        RemoteStore("127.0.0.1", port, 30, key=b"a guess")
    assert all(k.startswith(prefix) for k in trainer_store.table.values)  # nothing written by them
    group = join_group(trainer_store.store(), prefix, 0, 2, 30, cuda=False)
    send(group, state, plan, torch.device("cpu"))
    worker.join(timeout=60)
    assert torch.equal(got["w"], state["w"])


def test_the_store_listens_on_its_interface_only(trainer_store):
    # 127.0.0.2 is loopback too: a socket on every interface (torch's TCPStore) would answer there.
    port = trainer_store.address[1]
    assert trainer_store.address[0] == "127.0.0.1"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()
    RemoteStore("127.0.0.1", port, 30).close()


def test_a_squatter_on_the_store_port_learns_nothing_derived_from_the_key(run_secret):
    # A process that binds the port first and plays the store: the server's client proves nothing
    # to it (the store must prove itself first) and stops.
    listener = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def squat() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(HELLO + bytes(NONCE_BYTES))
            conn.settimeout(10)
            received.extend(conn.recv(NONCE_BYTES))  # the client's nonce
            conn.sendall(bytes(32))  # a proof it cannot compute
            while chunk := conn.recv(4096):
                received.extend(chunk)

    thread = threading.Thread(target=squat)
    thread.start()
    with pytest.raises(StoreRefused, match="not this run's trainer's"):
        RemoteStore("127.0.0.1", listener.getsockname()[1], 30)
    thread.join(timeout=30)
    listener.close()
    assert len(received) == NONCE_BYTES  # a random nonce, and nothing else


def test_a_stranger_that_connects_and_trickles_is_cut_off_and_cannot_hold_the_store(trainer_store):
    port = trainer_store.address[1]
    strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    for s in strangers:
        s.settimeout(30)
        assert s.recv(len(HELLO) + NONCE_BYTES).startswith(HELLO)
        s.sendall(b"x")  # one byte of a nonce, then nothing
    for s in strangers:  # each closed by the server's handshake deadline, not by us
        assert s.recv(1) == b""
        s.close()
    RemoteStore("127.0.0.1", port, 30).close()  # the run's own clients still get in


def test_a_frame_changed_on_the_way_is_refused(run_secret):
    a, b = socket.socketpair()
    sender = store_module.Channel(a, b"k" * 32, b"c", b"s")
    receiver = store_module.Channel(b, b"k" * 32, b"s", b"c")
    sender.send(["set", ["x", b"1"]])
    assert receiver.receive() == ["set", ["x", b"1"]]
    sender.send(["set", ["x", b"2"]])
    data = bytearray(b.recv(4096))
    data[-20] ^= 1  # one bit of the payload
    c, d = socket.socketpair()
    c.sendall(bytes(data))
    relayed = store_module.Channel(d, b"k" * 32, b"s", b"c")
    relayed._received = 1
    with pytest.raises(ConnectionError, match="not sealed"):
        relayed.receive()
    for s in (a, b, c, d):
        s.close()


def test_chunks_from_whoever_took_a_pair_are_refused_before_any_tensor_is_loaded(trainer_store):
    # gloo's pairs connect over plain TCP after the store introduced them: on CPU each chunk carries
    # a tag under the update's key, so bytes from anyone else break the update instead of filling it.
    port, state = trainer_store.address[1], {"a": torch.ones(4), "b": torch.zeros(3)}
    plan = make_plan(state, chunk_bytes=16)  # two chunks

    def update(prefix: str, sender_key: bytes) -> list:
        got: list = []

        def server_worker() -> None:
            group = join_group(RemoteStore("127.0.0.1", port, 30), prefix, 1, 2, 30, cuda=False)
            try:
                got.extend(n for n, _ in receive(group, plan, torch.device("cpu"), seal_key(prefix)))
            except Unsealed as e:
                got.append(e)

        worker = threading.Thread(target=server_worker)
        worker.start()
        group = join_group(trainer_store.store(), prefix, 0, 2, 30, cuda=False)
        send(group, state, plan, torch.device("cpu"), sender_key)
        worker.join(timeout=60)
        return got

    assert update("u1/", seal_key("u1/")) == ["a", "b"]
    (refused,) = update("u2/", b"someone else's key")
    assert isinstance(refused, Unsealed) and "chunk 0" in str(refused)
