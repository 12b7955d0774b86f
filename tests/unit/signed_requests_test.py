"""A process that takes a server's port (first, or while the server restarts) gets nothing it can
replay or turn into a key: the run's clients ask it to prove the run's key, and send it nothing more
when it cannot; nothing at all is sent to the open routes."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from prime_rl.auth import clients, signing
from prime_rl.engine.sampling import SamplingArgs
from prime_rl.orchestrator.envs.sampler import ConnectError, ServerSampler


@pytest.fixture
def squatter():
    """An HTTP server that answers everything 200 and keeps what it was sent."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _keep(self) -> None:
            size = int(self.headers.get("Content-Length") or 0)
            seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                         "body": self.rfile.read(size)})  # fmt: skip
            body = json.dumps({"proof": "00" * 32, "status": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _keep

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()
    server.server_close()


def test_a_squatter_gets_a_challenge_and_nothing_else(run_secret, squatter):
    url, seen = squatter
    with httpx.Client(auth=clients.auth()) as http:
        assert http.get(f"{url}/health").status_code == 200  # open: sent as is
        with pytest.raises(clients.ServerNotOurs, match="did not prove it holds this run's key"):
            http.post(f"{url}/prime_rl/load_weights", json={"path": "/x", "step": 1})
        with pytest.raises(httpx.HTTPError):  # (callers see a server that is down)
            http.get(f"{url}/prime_rl/weights")
    sampler = ServerSampler(f"{url}/v1", "model", timeout_s=10, retries=1)

    async def sample():
        try:
            await sampler.sample([1, 2, 3], SamplingArgs(temperature=1.0, max_tokens=4))
        finally:
            await sampler.close()

    with pytest.raises(ConnectError, match="did not prove"):
        asyncio.run(sample())
    assert [s["path"].split("?")[0] for s in seen] == ["/health"] + [signing.PROVE_PATH] * 4
    # Nothing it got is a signature, a token or the secret: only our random challenges.
    assert all("Authorization" not in s["headers"] and not s["body"] for s in seen)
    assert not any(run_secret in json.dumps(s, default=str) for s in seen)


def test_a_server_that_proves_the_key_gets_signed_requests_each_once(run_secret):
    # The inference server's door and a client of ours: proven once, then every request signed.
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from prime_rl.inference.authenticated import Authenticated

    app = FastAPI()

    @app.post("/work")
    async def work():
        return {"ok": True}

    app.add_middleware(Authenticated)
    client = TestClient(app)
    challenge, target = signing.prove_request()
    proof = client.get(target).json()["proof"]
    signing.check_proof(signing.request_key(), challenge, proof, "the server")  # it holds the key
    with pytest.raises(signing.ServerNotOurs):
        signing.check_proof(b"another key" * 3, challenge, proof, "the server")
    header = signing.sign(signing.request_key(), "POST", "/work", b"{}")
    assert client.post("/work", content=b"{}", headers={"Authorization": header}).status_code == 200
    assert client.post("/work", content=b"{}", headers={"Authorization": header}).status_code == 401


def test_a_run_whose_server_cannot_prove_its_key_stops_at_start_in_one_line(run_secret, squatter):
    # (A server started with another secret, or none, answers as the squatter does: no proof.)
    from prime_rl.orchestrator.config import ClientConfig
    from prime_rl.orchestrator.loop.servers import ServerPool
    from prime_rl.orchestrator.loop.weights_dir import SecretRefused, check_weights_dirs

    url, seen = squatter
    pool = ServerPool(ClientConfig(base_urls=[f"{url}/v1"]))
    with pytest.raises(SecretRefused) as e:
        asyncio.run(check_weights_dirs(pool, "/runs/x", adapter=False))
    assert "did not prove it holds this run's key" in str(e.value) and "\n" not in str(e.value)
    assert "PRIME_RL_SECRET_FILE" in str(e.value) and "PRIME_RL_TENANT_KEY_FILE" in str(e.value)
    assert all("Authorization" not in s["headers"] for s in seen)
