"""Runs sharing one inference server are tenants: the review's run B, holding what a tenant holds,
fails at every step of its attack on run A, and each run keeps the keys of its own secret."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from server_auth_test import Engine, make_app, published

from prime_rl.auth import clients, signing, tenant
from prime_rl.auth.clients import sign_request
from prime_rl.inference import adapters
from prime_rl.runtime import secret


@pytest.fixture
def shared(tmp_path, run_secret, monkeypatch):
    """A shared server (its owner's secret is this process's) with LoRA, and clients for tenants
    run-a and run-b."""

    async def noop(*args):
        return None

    monkeypatch.setattr(adapters, "_load", noop)
    monkeypatch.setattr(adapters, "_unload", noop)
    engine = Engine()
    app = make_app(tmp_path, engine, lora=True)

    def client(name: str, key: bytes | None = None) -> TestClient:
        c = TestClient(app)
        c.auth = lambda request: sign_request(request, key or tenant.key_for(name), name)
        return c

    return client, engine, published(tmp_path, 1)


def test_run_b_fails_at_every_step_of_the_reviews_attack_on_run_a(shared):
    client, engine, folder = shared
    a, b = client("run-a"), client("run-b")
    assert a.post("/prime_rl/load_adapter", json={"name": "run-a", "owner": "x", "path": str(folder), "step": 1}).status_code == 200  # fmt: skip
    # B once computed A's owner token from the shared secret; now the token given does not matter.
    for token in ("x", secret.owner_token("/runs/a")):
        assert b.post("/prime_rl/unload_adapter", json={"name": "run-a", "owner": token}).status_code == 409
        claim = {"name": "run-a", "owner": token, "path": str(folder), "step": 1}
        assert b.post("/prime_rl/load_adapter", json=claim).status_code == 409
    sample = {"model": "run-a", "messages": [{"role": "user", "content": "hi"}]}
    assert b.post("/v1/chat/completions", json=sample).status_code == 403  # not its adapter
    assert b.get("/prime_rl/adapters").json()["adapters"] == {}  # not even the name
    # The base weights and the server's own routes are the owner's.
    for path in (
        "/prime_rl/load_weights",
        "/prime_rl/receive_weights",
        "/v1/load_lora_adapter",
        "/collective_rpc",
    ):
        assert b.post(path, json={"path": str(folder), "step": 1}).status_code == 403, path
    assert b.get("/metrics").status_code == 403
    # Signing as A needs A's key, which only the owner can compute.
    assert tenant.key_for("run-a") != tenant.key_for("run-b")
    forged = client("run-a", key=tenant.key_for("run-b"))
    assert forged.post("/v1/chat/completions", json=sample).status_code == 401
    assert not [
        c for c in engine.calls if c[0] not in ("prime_rl_weight_bytes",)
    ]  # nothing reached the engine
    # What each may do still works: B samples the base model, A its own adapter.
    assert b.post("/v1/chat/completions", json={**sample, "model": "base"}).status_code == 200
    assert a.post("/v1/chat/completions", json=sample).status_code == 200
    assert a.get("/prime_rl/adapters").json()["adapters"] == {"run-a": {"step": 1}}
    assert a.post("/prime_rl/unload_adapter", json={"name": "run-a", "owner": "y"}).json()["released"] is True


def test_a_tenant_key_is_issued_by_the_owner_and_used_by_the_runs_clients(
    tmp_path, run_secret, monkeypatch, capsys
):
    path = tmp_path / "run-a.key"
    tenant.main(["run-a", str(path)])
    assert path.stat().st_mode & 0o777 == 0o600 and "PRIME_RL_TENANT_KEY_FILE" in capsys.readouterr().out
    name, hexkey = path.read_text().split()
    assert name == "run-a" and bytes.fromhex(hexkey) == tenant.key_for("run-a")
    for bad in ("orchestrator", "", "a b", "x" * 65):
        with pytest.raises(SystemExit):
            tenant.main([bad, str(tmp_path / "bad.key")])
    # The run: its clients sign as the tenant, whatever they would have signed as.
    monkeypatch.setenv(tenant.ENV, str(path))
    tenant.mine.cache_clear()
    try:
        assert clients.caller(signing.ORCHESTRATOR) == ("run-a", tenant.key_for("run-a"))
        path.chmod(0o644)
        tenant.mine.cache_clear()
        with pytest.raises(secret.SecretError, match="chmod 600"):
            clients.caller()
    finally:
        monkeypatch.delenv(tenant.ENV)
        tenant.mine.cache_clear()


def test_without_the_servers_secret_no_key_is_issued(no_secret, tmp_path, capsys):
    with pytest.raises(SystemExit):
        tenant.main(["run-a", str(tmp_path / "k")])
    assert "PRIME_RL_SECRET_FILE" in capsys.readouterr().err and not (tmp_path / "k").exists()


def test_a_tenants_request_body_is_json_naming_a_model(shared):
    client, _, _ = shared
    answer = client("run-b").post("/v1/completions", content=b"not json")
    assert answer.status_code == 403 and "names its model" in json.loads(answer.text)["error"]
