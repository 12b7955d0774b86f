"""Runs that share a real vLLM server are its tenants: run A trains its adapter through `rl` with a
tenant key the server's owner issued, while run B, with a tenant key of its own, tries the review's
attack on A's adapter and on the base weights mid-run and is refused at every step; A learns on."""

import os
import subprocess
import time

import httpx
import pytest
from lora_rl_test import ENVS, RL, metrics, write_config

from prime_rl.auth import tenant
from prime_rl.auth.clients import Signed
from prime_rl.runtime import secret

pytestmark = pytest.mark.slow


def test_a_tenant_trains_its_adapter_and_another_tenant_cannot_touch_it(
    tiny_model, tmp_path, start_vllm, monkeypatch
):
    owner_secret = secret.create(tmp_path / "owner")  # the shared server's own secret
    monkeypatch.setenv(secret.FILE_ENV, str(owner_secret))
    monkeypatch.delenv(secret.ENV, raising=False)
    secret.value.cache_clear()
    runs = tmp_path / "runs"
    runs.mkdir()
    keys = {name: tenant.issue(name, tmp_path / f"{name}.key") for name in ("alice", "bob")}
    lora = {"max_rank": 8, "max_adapters": 2, "runs_root": str(runs)}
    with start_vllm(tiny_model, tmp_path / "inference", 256, lora=lora) as served:
        # Run A: its own output folder (its own run secret, made by `rl`), the server's tenant key.
        env = {k: v for k, v in os.environ.items() if k not in (secret.ENV, secret.FILE_ENV)}
        env.update(PYTHONPATH=ENVS, **{tenant.ENV: str(keys["alice"])})
        alice = subprocess.Popen([RL, "@", str(write_config(runs, "alice", tiny_model, served.base, 4))],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
        bob = httpx.Client(base_url=served.base, timeout=60, auth=Signed(tenant.key_for("bob"), "bob"))
        try:
            # Wait until A holds its adapter's name on the server (the owner may look).
            deadline = time.monotonic() + 600
            while not (runs / "alice" / "weights" / "step_1" / "READY").exists():
                assert alice.poll() is None, alice.stdout.read()[-4000:]
                assert time.monotonic() < deadline, "run A published no step"
                time.sleep(0.5)
            step_1 = str(runs / "alice" / "weights" / "step_1")
            # B's attack, step by step: unload A's adapter, claim its name, sample from it, list it,
            # push base weights, and vLLM's own adapter routes.
            assert (
                bob.post("/prime_rl/unload_adapter", json={"name": "alice", "owner": "x"}).status_code == 409
            )
            claim = {"name": "alice", "owner": "x", "path": step_1, "step": 1}
            assert bob.post("/prime_rl/load_adapter", json=claim).status_code == 409
            sample = {"model": "alice", "prompt": "hello", "max_tokens": 2}
            assert bob.post("/v1/completions", json=sample).status_code == 403
            assert bob.get("/prime_rl/adapters").json()["adapters"] == {}
            assert bob.post("/prime_rl/load_weights", json={"path": step_1, "step": 1}).status_code == 403
            lora_route = {"lora_name": "alice", "lora_path": step_1}
            assert bob.post("/v1/load_lora_adapter", json=lora_route).status_code == 403
            assert bob.get("/metrics").status_code == 403
            # What B may do: sample the base model.
            assert bob.post("/v1/completions", json={**sample, "model": served.model}).status_code == 200
            out, _ = alice.communicate(timeout=900)
        finally:
            if alice.poll() is None:
                alice.kill()
        assert alice.returncode == 0, out[-4000:]
        orch, trainer = metrics(runs / "alice", "orchestrator"), metrics(runs / "alice", "trainer")
        assert [m["policy_version"] for m in orch] == [0, 1, 2, 3]  # A sampled its own adapter each step
        assert max(m["mismatch_kl/all/mean"] for m in trainer) < 1e-2
        # A released its name at its end: now anyone may claim it.
        assert bob.post("/prime_rl/load_adapter", json={"name": "alice", "owner": "x"}).status_code == 200
        assert bob.post("/prime_rl/unload_adapter", json={"name": "alice", "owner": "x"}).json()["released"]
        bob.close()
    # A's keys are its own: its run secret is not the server's, so B (or the owner) derives none of
    # A's transport or checkpoint keys from what it holds.
    assert secret.read(runs / "alice" / secret.FILE_NAME) != secret.read(owner_secret)
    secret.value.cache_clear()
