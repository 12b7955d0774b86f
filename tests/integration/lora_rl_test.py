"""Two LoRA runs share one real vLLM server as its tenants: each `rl` trains its own adapter against
the running server (`deployment.inference_urls`) with the tenant key the server's owner issued,
samples from it with the trainer's logprobs, releases its name at the end, and one of them then
resumes on its own."""

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from prime_rl.auth import clients, tenant
from prime_rl.auth.clients import Signed
from prime_rl.runtime import secret
from prime_rl.runtime.net import free_port

pytestmark = pytest.mark.slow

RL = str(Path(sys.executable).parent / "rl")
ENVS = str(Path(__file__).parents[1] / "envs")


def write_config(runs: Path, name: str, model: Path, server: str, steps: int) -> Path:
    toml = runs / f"{name}.toml"
    toml.write_text(
        f"""
model = "{model}"
output_dir = "{runs / name}"
max_steps = {steps}
seq_len = 256
# Synchronous: every step samples from the adapter it trains, so the mismatch KL below is the
# sampler's and trainer's disagreement alone, not one step of policy change.
max_async_level = 0

[deployment]
inference_urls = ["{server}"]

[trainer.lora]
rank = 8
alpha = 16

[trainer.optim]
lr = 3e-2

[trainer.ckpt]
interval = 2

[orchestrator]
batch_size = 16

[orchestrator.transport]
port = {free_port()}

[[orchestrator.envs]]
id = "short-answer-env"
group_size = 8
sampling = {{ temperature = 1.0, max_tokens = 16 }}
"""
    )
    return toml


def metrics(run: Path, process: str) -> list[dict]:
    return [json.loads(line) for line in (run / process / "metrics.jsonl").read_text().splitlines()]


def scored(base: str, model: str, auth=None) -> torch.Tensor:
    """The logprobs `model` gives its own seeded samples of fixed prompts."""
    out = []
    for prompt in ("hello", "reverse: abc", "what is 2+2"):
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                "temperature": 1.0, "seed": 7, "logprobs": True}  # fmt: skip
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120, auth=auth).json()
        out += [t["logprob"] for t in reply["choices"][0]["logprobs"]["content"]]
    return torch.tensor(out)


def test_two_runs_train_their_own_adapters_on_one_server(tiny_model, tmp_path, start_vllm, monkeypatch):
    # The server's owner keeps its secret and issues each run a tenant key (docs/lora.md).
    monkeypatch.setenv(secret.FILE_ENV, str(secret.create(tmp_path / "owner")))
    monkeypatch.delenv(secret.ENV, raising=False)
    secret.value.cache_clear()
    runs = tmp_path / "runs"  # the shared server's runs_root
    runs.mkdir()
    keys = {name: tenant.issue(name, tmp_path / f"{name}.key") for name in ("alice", "bob")}
    lora = {"max_rank": 8, "max_adapters": 2, "runs_root": str(runs)}
    with start_vllm(tiny_model, tmp_path / "inference", 256, lora=lora) as served:
        try:
            run_two_and_resume_one(served, runs, tiny_model, keys)
        finally:
            secret.value.cache_clear()


def run_two_and_resume_one(served, runs: Path, tiny_model, keys: dict[str, Path]) -> None:
    owner = clients.auth()  # the test speaks as the server's owner

    def env(name: str) -> dict[str, str]:
        # Each run: its own secret (`rl` makes it), the tenant key its owner issued.
        base = {
            k: v
            for k, v in os.environ.items()
            if k not in (secret.ENV, secret.FILE_ENV, secret.NO_SECRET_ENV)
        }
        return {**base, "PYTHONPATH": ENVS, tenant.ENV: str(keys[name])}

    procs = {
        name: subprocess.Popen([RL, "@", str(write_config(runs, name, tiny_model, served.base, 4))],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(name))
        for name in ("alice", "bob")
    }  # fmt: skip
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name}:\n{out[-4000:]}"
    for name in procs:
        trainer, orch = metrics(runs / name, "trainer"), metrics(runs / name, "orchestrator")
        assert [m["step"] for m in trainer] == list(range(4))
        assert [m["policy_version"] for m in orch] == [0, 1, 2, 3]  # each step's adapter sampled
        # Each run samples from its own adapter: the sampler's logprobs are the trainer's.
        assert max(m["mismatch_kl/all/mean"] for m in trainer) < 1e-2, [
            m["mismatch_kl/all/mean"] for m in trainer
        ]
        assert (runs / name / "weights" / "step_4" / "adapter_model.safetensors").exists()
        assert not (runs / name / "weights" / "step_4" / "model.safetensors").exists()
        # Each released its name at the end.
        mine = httpx.get(f"{served.base}/prime_rl/adapters", auth=Signed(tenant.key_for(name), name))
        assert mine.json()["adapters"] == {}

    # The two trained adapters differ from each other and from the base model.
    for name in procs:
        body = {
            "name": f"check-{name}",
            "owner": "test",
            "path": str(runs / name / "weights" / "step_4"),
            "step": 4,
        }
        assert httpx.post(f"{served.base}/prime_rl/load_adapter", json=body, auth=owner).status_code == 200
    a, b, base = (
        scored(served.base, "check-alice", owner),
        scored(served.base, "check-bob", owner),
        scored(served.base, served.model, owner),
    )
    assert not torch.allclose(a, b, atol=1e-3) and not torch.allclose(a, base, atol=1e-3)

    # Alice goes on alone from her checkpoint.
    again = subprocess.run([RL, "@", str(runs / "alice.toml"), "--max-steps", "6"], capture_output=True,
                           text=True, env=env("alice"), timeout=900)  # fmt: skip
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-4000:]
    trainer = metrics(runs / "alice", "trainer")
    assert [m["step"] for m in trainer] == list(range(6))
    assert max(m["mismatch_kl/all/mean"] for m in trainer[4:]) < 1e-2
