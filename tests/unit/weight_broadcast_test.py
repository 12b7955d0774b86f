"""The collective weight broadcast's pieces: the chunk plan over a real gloo group, and the trainer
falling back to files when the group cannot be formed (so no step goes unpublished)."""

import logging
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from fake_server import FakeServer
from prime_rl.auth.store import RemoteStore, StoreServer, Table
from prime_rl.runtime.net import free_port
from prime_rl.trainer.config import WeightBroadcastConfig
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.weights.broadcast import Broadcaster, BroadcastError
from prime_rl.trainer.weights.publish import Publisher
from prime_rl.transport.weight_transfer import (
    chunk_bytes,
    join_group,
    make_plan,
    pack_chunk,
    plan_from_json,
    plan_to_json,
    receive,
    send,
    unpack_chunk,
)


def test_a_state_dict_crosses_a_gloo_group_in_chunks_intact():
    state = {"emb": torch.randn(50, 8), "norm": torch.ones(8, dtype=torch.bfloat16),
             "big": torch.randn(300), "idx": torch.arange(7), "last": torch.randn(2, 3, 4)}  # fmt: skip
    plan = make_plan(state, chunk_bytes=1024)
    # Tensors stay whole and in order; a chunk only grows past the limit with a single big tensor.
    assert [e.name for chunk in plan for e in chunk] == list(state)
    assert all(chunk_bytes(c) <= 1024 or len(c) == 1 for c in plan) and len(plan) > 1
    server, received = StoreServer("127.0.0.1", free_port(), timeout_s=30), {}
    port = server.address[1]

    def worker(rank: int) -> None:
        group = join_group(RemoteStore("127.0.0.1", port, 30), "u/", rank, 3, 30, cuda=False)
        for name, tensor in receive(group, plan_from_json(plan_to_json(plan)), torch.device("cpu")):
            received[(rank, name)] = tensor.clone() if rank == 1 else tensor  # views of fresh buffers

    threads = [threading.Thread(target=worker, args=(r,)) for r in (1, 2)]
    for t in threads:
        t.start()
    group = join_group(server.store(), "u/", 0, 3, 30, cuda=False)
    send(group, state, plan, torch.device("cpu"))
    for t in threads:
        t.join(timeout=60)
    assert len(received) == 2 * len(state)
    for (_, name), tensor in received.items():
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name]), name


def test_floating_point_weights_travel_in_the_servers_dtype():
    state = {"w": torch.randn(4, 4), "steps": torch.arange(3)}
    plan = make_plan(state, chunk_bytes=1 << 20, cast="bfloat16")
    assert [(e.name, e.dtype) for e in plan[0]] == [("w", "bfloat16"), ("steps", "int64")]
    assert chunk_bytes(plan[0]) == 16 * 2 + 3 * 8  # half the float bytes
    got = dict(unpack_chunk(pack_chunk(state, plan[0], torch.device("cpu")), plan[0]))
    assert torch.equal(got["w"], state["w"].to(torch.bfloat16)) and torch.equal(got["steps"], state["steps"])


def test_no_server_answering_is_a_broadcast_error_at_once(monkeypatch):
    # At once: before any group is set up, so no wait for members that will never join (timeout_s).
    from prime_rl.trainer.weights import broadcast

    stores = []
    monkeypatch.setattr(broadcast, "StoreServer", lambda *args: stores.append(args))
    config = WeightBroadcastConfig(
        type="collective", servers=[f"http://127.0.0.1:{free_port()}"], port=free_port()
    )
    with pytest.raises(BroadcastError, match="no inference server answered"):
        Broadcaster(config).push(1, {"w": torch.zeros(2)})
    assert stores == []


def test_a_server_that_never_joins_makes_the_trainer_write_that_steps_files(tiny_model, tmp_path):
    # The fake server answers the health and weights routes but has no broadcast route: the group
    # never forms, the update fails after timeout_s, and the step is published as files instead.
    with FakeServer() as server:
        url = server.base_url.removesuffix("/v1")
        config = WeightBroadcastConfig(type="collective", servers=[url], port=free_port(), timeout_s=2)
        publisher = Publisher(tmp_path, str(tiny_model), World(), keep=3, broadcaster=Broadcaster(config))
        model = AutoModelForCausalLM.from_pretrained(tiny_model)
        publisher.publish(model, 1)
        publisher.close()
    folder = tmp_path / "weights" / "step_1"
    assert (folder / "READY").exists() and (folder / "model.safetensors").exists()
    assert not (folder / "BROADCAST").exists()  # the orchestrator loads it from the files
    assert publisher.last_broadcast == 0.0


def test_a_group_that_breaks_once_is_formed_again_and_the_step_is_broadcast(caplog):
    # A server that refuses its first update (as when gloo's mesh lost a connection) and takes the
    # second: the trainer gives the first up at once (not after timeout_s, the default 120 s, waiting
    # for a member that answered it will not join) and tries a fresh group, so the step still
    # travels in memory.
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    state, received, posts = {"w": torch.randn(3, 3)}, {}, []

    class Server(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self.reply(200, {"workers": 1, "dtype": "float32"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            posts.append(body["prefix"])
            if len(posts) == 1:
                return self.reply(500, {"error": "Gloo connectFullMesh failed"})
            store = RemoteStore(body["host"], body["port"], body["timeout_s"])
            group = join_group(store, body["prefix"], body["first_rank"], body["world_size"], 30, False)
            for name, tensor in receive(group, plan_from_json(body["plan"]), torch.device("cpu")):
                received[name] = tensor.clone()
            self.reply(200, {})

    http = ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{http.server_address[1]}"
        config = WeightBroadcastConfig(type="collective", servers=[url], port=free_port())
        with caplog.at_level(logging.WARNING, logger="prime_rl.trainer.weights.broadcast"):
            pushed = Broadcaster(config).push(1, state)
    finally:
        http.shutdown()
    assert pushed.servers == [url]
    assert len(posts) == 2 and posts[0] != posts[1]  # a fresh group, not the broken one
    assert torch.equal(received["w"], state["w"])
    (retry,) = [r.getMessage() for r in caplog.records if "trying once more" in r.getMessage()]
    assert "was abandoned" in retry and f"{url} answered HTTP 500" in retry, retry


def test_a_wait_on_an_abandoned_update_ends_at_once_and_names_why():
    table = Table()
    table.set("prime_rl/step_1/a/0", b"rank 0")
    table.abandon("prime_rl/step_1/a/", "http://server answered HTTP 500")
    with pytest.raises(RuntimeError, match="abandoned: http://server answered HTTP 500"):
        table.wait(["prime_rl/step_1/a/0", "prime_rl/step_1/a/1"], timeout_s=3600)
    table.wait(["prime_rl/step_1/a/0"], timeout_s=3600)  # a key that is there is there
    table.set("prime_rl/step_2/b/0", b"rank 0")  # another update waits as before
    table.wait(["prime_rl/step_2/b/0"], timeout_s=3600)
    table.drop("prime_rl/step_1/a/")  # the update is gone, and so is its abandonment
    with pytest.raises(TimeoutError):
        table.wait(["prime_rl/step_1/a/1"], timeout_s=0)
