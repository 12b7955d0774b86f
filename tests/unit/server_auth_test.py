"""The inference server's routes under a run secret, with vLLM's engine replaced by a recorder: who
may call them, and which weight updates they take (the real server runs them in
tests/integration/rl_test.py and vllm_server_test.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from fastapi import FastAPI
from fastapi.testclient import TestClient

from conftest import RUN_SECRET
from prime_rl.auth import signing
from prime_rl.auth.clients import sign_request
from prime_rl.auth.store import StoreServer
from prime_rl.inference import adapters, authenticated, vllm_server
from prime_rl.inference.authenticated import Authenticated
from prime_rl.runtime import secret
from prime_rl.runtime.layout import WEIGHTS, write_manifest
from prime_rl.runtime.net import free_port

SECRET = RUN_SECRET


class Engine:
    """Records the calls the routes make; `fail` names an rpc that raises."""

    def __init__(self, fail: str | None = None):
        self.calls: list[tuple] = []
        self.fail = fail

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause", mode))

    async def resume_generation(self) -> None:
        self.calls.append(("resume",))

    async def collective_rpc(self, method: str, args: tuple = ()):
        self.calls.append((method, args))
        if method == self.fail:
            raise RuntimeError("a worker died")
        return [1000] if method == "prime_rl_weight_bytes" else [None]


def make_app(weights_dir, engine: Engine, max_update_s: float = 60.0, lora: bool = False) -> FastAPI:
    app = FastAPI()
    app.include_router(vllm_server.make_router(weights_dir, max_update_s))
    adapter_router = adapters.make_adapter_router(weights_dir)
    app.include_router(adapter_router)
    app.state.prime_rl_adapters = adapter_router.served

    @app.get("/health")
    async def health():
        return {}

    @app.post("/v1/chat/completions")
    async def chat():
        engine.calls.append(("generate",))
        return {}

    app.state.engine_client = engine
    if lora:
        app.state.vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_lora_rank=8))
        app.state.openai_serving_models = SimpleNamespace(is_base_model=lambda name: name == "base")
    app.add_middleware(Authenticated)
    return app


def published(weights_dir, step: int):
    """A step's folder as the trainer publishes it: its keyed manifest, then READY."""
    folder = weights_dir / f"step_{step}"
    folder.mkdir(parents=True)
    write_manifest(folder, WEIGHTS)
    (folder / "READY").touch()
    return folder


def signed(app) -> TestClient:
    """A client that signs its requests as the run's do."""
    client = TestClient(app)  # (starlette's client is another httpx: its requests, signed as ours)
    client.auth = lambda request: sign_request(request, signing.request_key())
    return client


def forged(kind: str, method: str, path: str, body: bytes) -> dict:
    """What a caller without the run's request key can send."""
    if kind == "none":
        return {}
    if kind == "the-secret-itself":  # what every client sent before requests were signed
        return {"Authorization": f"Bearer {SECRET}"}
    if kind == "another-key":
        return {"Authorization": signing.sign(b"k" * 32, method, path, body)}
    # A signature of the run's for another request (read, say, off the wire).
    return {"Authorization": signing.sign(signing.request_key(), "GET", "/prime_rl/weights", b"")}


ROUTES = [
    ("post", "/prime_rl/load_weights"),
    ("post", "/prime_rl/receive_weights"),
    ("post", "/prime_rl/load_adapter"),
    ("post", "/prime_rl/unload_adapter"),
    ("get", "/prime_rl/adapters"),
    ("get", "/prime_rl/weights"),
    ("post", "/v1/chat/completions"),
    ("get", "/metrics"),  # it names the adapters and the model
]


@pytest.mark.parametrize("kind", ["none", "the-secret-itself", "another-key", "another-request"])
def test_every_route_but_health_needs_a_signature_and_a_refusal_changes_nothing(
    tmp_path, run_secret, kind, capsys, monkeypatch
):
    monkeypatch.setattr(authenticated, "_refusals", {"unsaid": 0, "last": None})
    engine = Engine()
    folder = published(tmp_path, 1)
    client = TestClient(make_app(tmp_path, engine))
    body = json.dumps({"path": str(folder), "step": 1, "name": "a", "owner": "x"}).encode()
    for method, path in ROUTES:
        content = body if method == "post" else b""
        headers = {"Content-Type": "application/json", **forged(kind, method, path, content)}
        if kind == "another-request" and path == "/prime_rl/weights":
            continue  # the very request it signs
        answer = client.request(method, path, headers=headers, content=content)
        assert answer.status_code == 401, (path, answer.text)
    assert engine.calls == []  # nothing paused, loaded or generated
    assert client.get("/health").status_code == 200
    assert signed(make_app(tmp_path, engine)).get("/prime_rl/weights").json()["step"] == 0
    log = capsys.readouterr().err
    assert "refused POST /prime_rl/load_weights" in log
    assert log.count("\n") == 1  # one line for the whole flood


def test_a_signed_request_is_taken_once_and_only_as_signed(tmp_path, run_secret):
    engine = Engine()
    client = TestClient(make_app(tmp_path, engine))
    good = {"Authorization": signing.sign(signing.request_key(), "GET", "/prime_rl/weights", b"")}
    assert client.get("/prime_rl/weights", headers=good).status_code == 200
    assert client.get("/prime_rl/weights", headers=good).status_code == 401  # replayed
    body = json.dumps({"path": str(published(tmp_path, 1)), "step": 1}).encode()
    header = signing.sign(signing.request_key(), "POST", "/prime_rl/load_weights", body)
    changed = body.replace(b'"step": 1', b'"step": 9')
    answer = client.post("/prime_rl/load_weights", content=changed, headers={"Authorization": header})
    assert answer.status_code == 401 and engine.calls == []  # the body is not the one signed
    old = signing.sign(signing.request_key(), "GET", "/prime_rl/weights", b"")
    t = int(old.split("t=")[1].split(",")[0])
    stale = old.replace(f"t={t}", f"t={t - 3600}")  # (and so its signature no longer matches either)
    assert client.get("/prime_rl/weights", headers={"Authorization": stale}).status_code == 401


def test_without_a_secret_every_caller_is_accepted(tmp_path, monkeypatch):
    monkeypatch.delenv(secret.ENV, raising=False)
    monkeypatch.delenv(secret.FILE_ENV, raising=False)
    secret.value.cache_clear()
    client = TestClient(make_app(tmp_path, Engine()))
    assert client.get("/prime_rl/weights").status_code == 200


def test_load_weights_takes_only_a_newer_step_from_its_own_folder(tmp_path, run_secret):
    engine = Engine()
    client = signed(make_app(tmp_path, engine))
    one, two = published(tmp_path, 1), published(tmp_path, 2)

    def load(path, step, **extra):
        return client.post("/prime_rl/load_weights", json={"path": str(path), "step": step, **extra})

    assert load(one, 2).status_code == 400  # step 1's weights labelled as step 2
    assert load(one, -2).status_code == 400  # would read as BROKEN
    assert load(two, 2).json()["step"] == 2
    assert load(one, 1).status_code == 409  # older than served
    assert load(two, 2).json()["step"] == 2  # the same step again: idempotent (a restarted run)
    assert client.get("/prime_rl/weights").json()["step"] == 2
    assert load(one, 1, rewind=True).status_code == 409  # any caller of the run's but the orchestrator
    client.auth = lambda request: sign_request(request, signing.request_key("orchestrator"), "orchestrator")
    assert load(one, 1, rewind=True).json()["step"] == 1  # the orchestrator bringing a server back


def test_a_failed_load_marks_the_server_broken(tmp_path, run_secret):
    engine = Engine(fail="prime_rl_reload")
    client = signed(make_app(tmp_path, engine))
    answer = client.post("/prime_rl/load_weights", json={"path": str(published(tmp_path, 1)), "step": 1})
    assert answer.status_code == 500
    assert client.get("/prime_rl/weights").json()["step"] == vllm_server.BROKEN
    assert ("pause", "abort") in engine.calls and engine.calls[-1] == ("resume",)


@pytest.fixture
def store(run_secret):
    """The trainer's store: it proves the run's key to every client."""
    server = StoreServer("127.0.0.1", free_port(), timeout_s=10)
    yield server, server.address[1]
    server.close()


def receive_body(port: int, prefix: str, shape=(10,), timeout_s: float = 3600.0) -> dict:
    return {
        "step": 1, "host": "127.0.0.1", "port": port, "prefix": prefix, "first_rank": 1, "world_size": 2,
        "plan": [[["w", "float32", list(shape)]]], "timeout_s": timeout_s,
    }  # fmt: skip


def test_receive_weights_joins_only_a_store_that_proves_the_secret(tmp_path, run_secret, store):
    _, port = store
    engine = Engine()
    client = signed(make_app(tmp_path, engine, max_update_s=5.0))
    prefix = "prime_rl/step_1/0123456789abcdef/"
    # A store keyed otherwise (a neighbour's), and torch's TCPStore, are refused before anything pauses.
    neighbours = StoreServer("127.0.0.1", free_port(), timeout_s=10, key=b"a neighbour's key")
    tcp_port = free_port()
    tcp = dist.TCPStore("127.0.0.1", tcp_port, is_master=True, wait_for_workers=False)  # noqa: F841
    for other in (neighbours.address[1], tcp_port):
        answer = client.post("/prime_rl/receive_weights", json=receive_body(other, prefix))
        assert answer.status_code == 403
        assert "not this run's trainer's" in answer.text or "handshake" in answer.text
    neighbours.close()
    assert [c for c in engine.calls if c[0] != "prime_rl_weight_bytes"] == []
    assert client.get("/prime_rl/weights").json()["step"] == 0  # not BROKEN
    # The trainer's store: it proves the key only a holder of the secret can derive.
    assert client.post("/prime_rl/receive_weights", json=receive_body(port, prefix)).status_code == 200
    (receive,) = [c[1] for c in engine.calls if c[0] == "prime_rl_receive"]
    assert receive[-2] == 5.0  # the caller asked for an hour; the server's bound holds
    assert receive[-1] is True  # a server with the secret takes only sealed chunks on CPU


def test_a_broadcast_that_fails_midway_marks_the_server_broken_until_a_good_update(
    tmp_path, run_secret, store
):
    _, port = store
    engine = Engine(fail="prime_rl_receive")
    client = signed(make_app(tmp_path, engine))
    prefix = "prime_rl/step_1/0123456789abcdef/"
    answer = client.post("/prime_rl/receive_weights", json=receive_body(port, prefix))
    assert answer.status_code == 500 and "a worker died" in answer.json()["error"]
    assert client.get("/prime_rl/weights").json()["step"] == vllm_server.BROKEN
    # The paused requests ran on half-updated weights: aborted, and generation resumes after.
    assert ("pause", "abort") in engine.calls and engine.calls[-1] == ("resume",)
    engine.fail = None
    assert client.post("/prime_rl/receive_weights", json=receive_body(port, prefix)).status_code == 200
    assert client.get("/prime_rl/weights").json()["step"] == 1


def test_receive_weights_refuses_a_plan_far_bigger_than_the_model(tmp_path, run_secret, store):
    _, port = store
    engine = Engine()
    client = signed(make_app(tmp_path, engine))
    answer = client.post("/prime_rl/receive_weights", json=receive_body(port, "p/", shape=(10**9,)))
    assert answer.status_code == 413  # 4 GB asked of a server holding 1000 bytes
    bad = receive_body(port, "p/")
    bad["plan"] = [[["w", "complex-thing", [10]]]]
    assert client.post("/prime_rl/receive_weights", json=bad).status_code == 400
    assert all(name == "prime_rl_weight_bytes" for name, *_ in engine.calls)


def test_a_neighbours_adapter_cannot_be_seen_unloaded_replaced_or_claimed(tmp_path, run_secret, monkeypatch):
    async def noop(*args):
        return None

    monkeypatch.setattr(adapters, "_load", noop)
    monkeypatch.setattr(adapters, "_unload", noop)
    client = signed(make_app(tmp_path, Engine(), lora=True))
    victim, neighbour = secret.owner_token("/runs/victim"), secret.owner_token("/runs/neighbour")
    assert victim != neighbour and "/runs/victim" not in victim
    folder = published(tmp_path, 1)

    def post(route, owner, **body):
        return client.post(f"/prime_rl/{route}", json={"name": "victim", "owner": owner, **body})

    assert post("load_adapter", victim, path=str(folder), step=1).status_code == 200
    assert post("unload_adapter", neighbour).status_code == 409
    assert post("load_adapter", neighbour, path=str(folder), step=1).status_code == 409
    assert post("load_adapter", "/runs/victim").status_code == 409  # the folder's name is no key
    seen = client.get("/prime_rl/adapters", headers={secret.OWNER_HEADER: neighbour}).json()["adapters"]
    assert seen == {}  # not even the name
    mine = client.get("/prime_rl/adapters", headers={secret.OWNER_HEADER: victim}).json()["adapters"]
    assert mine == {"victim": {"step": 1}}
    assert post("unload_adapter", victim).json()["released"] is True


def test_a_server_beyond_loopback_without_a_secret_refuses_to_start(monkeypatch):
    from prime_rl.inference.config import InferenceConfig
    from prime_rl.inference.preflight import bind_problems

    monkeypatch.delenv(secret.ENV, raising=False)
    monkeypatch.delenv(secret.FILE_ENV, raising=False)
    secret.value.cache_clear()
    (problem,) = bind_problems(InferenceConfig(server={"host": "0.0.0.0"}))
    assert "'server.host' = '0.0.0.0'" in problem and secret.FILE_ENV in problem
    assert "server.allow_unauthenticated = true" in problem
    assert bind_problems(InferenceConfig()) == []  # loopback
    # vLLM takes the last --host: one in extra_args is the address it binds (the review's way around).
    for extra in (["--host", "0.0.0.0"], ["--host=0.0.0.0"]):
        (problem,) = bind_problems(InferenceConfig(extra_args=extra))
        assert "'extra_args' --host = '0.0.0.0'" in problem
    assert secret.bound_host(["--host", "127.0.0.1", "--port", "1", "--host", "::"], "x") == "::"
    assert bind_problems(InferenceConfig(server={"host": "0.0.0.0", "allow_unauthenticated": True})) == []
    monkeypatch.setenv(secret.ENV, SECRET)
    secret.value.cache_clear()
    assert bind_problems(InferenceConfig(server={"host": "0.0.0.0"})) == []
    secret.value.cache_clear()


def test_the_secret_file_is_the_owners_alone_and_kept_for_a_resumed_run(tmp_path, monkeypatch):
    path = secret.create(tmp_path)
    assert path.stat().st_mode & 0o777 == 0o600 and len(secret.read(path)) >= 32
    first = secret.read(path)
    assert secret.create(tmp_path) == path and secret.read(path) == first  # kept, not made again
    path.chmod(0o644)
    with pytest.raises(secret.SecretError, match="chmod 600"):
        secret.read(path)
    monkeypatch.setenv(secret.FILE_ENV, str(tmp_path / "missing"))
    monkeypatch.delenv(secret.ENV, raising=False)
    secret.value.cache_clear()
    with pytest.raises(secret.SecretError, match="cannot read the secret file"):
        secret.value()
    secret.value.cache_clear()


def test_by_hand_the_first_process_makes_the_runs_secret_and_the_others_read_it(tmp_path, monkeypatch):
    # No secret given and no opt-out: safe by default. (Set, then removed, through monkeypatch: it
    # puts back what was there before, whatever `ensure` writes into the environment meanwhile.)
    for name in (secret.ENV, secret.FILE_ENV, secret.NO_SECRET_ENV):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    secret.value.cache_clear()
    try:
        made = secret.ensure(tmp_path / "run")  # the first process (say, the server)
        assert (
            made == (tmp_path / "run" / secret.FILE_NAME).resolve() and made.stat().st_mode & 0o777 == 0o600
        )
        first = secret.value()
        monkeypatch.delenv(secret.FILE_ENV)  # another process of the run, started apart
        secret.value.cache_clear()
        assert secret.ensure(tmp_path / "run") == made and secret.value() == first
        # The explicit opt-out: nothing made, nothing taken.
        monkeypatch.delenv(secret.FILE_ENV)
        monkeypatch.setenv(secret.NO_SECRET_ENV, "1")
        secret.value.cache_clear()
        assert secret.ensure(tmp_path / "other") is None and secret.value() is None
        assert not (tmp_path / "other").exists()
    finally:
        secret.value.cache_clear()
