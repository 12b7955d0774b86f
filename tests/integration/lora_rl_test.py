"""Two LoRA runs share one real vLLM server as its tenants: each `rl` trains its own adapter against
the running server (`deployment.inference_urls`) with the tenant key the server's owner issued,
samples from it with the trainer's logprobs, releases its name at the end; then one of them resumes
on its own while the other tenant tries the review's attack on its adapter and on the base weights
mid-run, and is refused at every step.

One server and one sequence of runs serve both tests (a module fixture): they are one story, told
once, and each test reads its part of it."""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import torch

from prime_rl.auth import clients, tenant
from prime_rl.auth.clients import Signed
from prime_rl.runtime import secret
from prime_rl.runtime.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("tenants")]

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


@dataclass
class Story:
    """What happened on the shared server, for the tests to read."""

    runs: Path
    """The server's runs_root: alice's and bob's output folders."""
    first: dict[str, tuple[int, str]] = field(default_factory=dict)
    """Each run's first `rl` (4 steps, both at once): exit status and output."""
    published: dict[str, list[str]] = field(default_factory=dict)
    """The files of each run's step 4 after its first `rl` (alice's later steps replace them)."""
    released: dict[str, dict] = field(default_factory=dict)
    """The adapters each tenant held on the server after its run ended."""
    scores: dict[str, torch.Tensor] = field(default_factory=dict)
    """Logprobs of fixed samples: alice's and bob's step-4 adapters, and the base model."""
    again: tuple[int, str] = (-1, "not run: a first run failed")
    """Alice's resumed `rl` (steps 4-7, alone): exit status and output."""
    attack: dict[str, int] = field(default_factory=dict)
    """Bob's requests against alice's adapter and the base weights during alice's resumed run: status."""
    after: dict[str, object] = field(default_factory=dict)
    """Bob's claim of alice's name once her run ended."""
    own_secret: bool = False
    """Whether alice's run secret differs from the server's."""


@pytest.fixture(scope="module")
def story(tiny_model, tmp_path_factory, start_vllm) -> Story:
    tmp = tmp_path_factory.mktemp("tenants")
    with pytest.MonkeyPatch.context() as mp:
        # The server's owner keeps its secret and issues each run a tenant key (docs/lora.md).
        owner_secret = secret.create(tmp / "owner")
        mp.setenv(secret.FILE_ENV, str(owner_secret))
        mp.delenv(secret.ENV, raising=False)
        secret.value.cache_clear()
        runs = tmp / "runs"  # the shared server's runs_root
        runs.mkdir()
        keys = {name: tenant.issue(name, tmp / f"{name}.key") for name in ("alice", "bob")}
        lora = {"max_rank": 8, "max_adapters": 2, "runs_root": str(runs)}
        try:
            with start_vllm(tiny_model, tmp / "inference", 256, lora=lora) as served:
                story = tell(served, runs, tiny_model, keys)
            story.own_secret = secret.read(runs / "alice" / secret.FILE_NAME) != secret.read(owner_secret)
        finally:
            secret.value.cache_clear()
    return story


def tell(served, runs: Path, tiny_model, keys: dict[str, Path]) -> Story:
    story = Story(runs)
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
    try:
        for name, proc in procs.items():
            out, _ = proc.communicate(timeout=900)
            story.first[name] = (proc.returncode, out)
    finally:  # one that hung (or a failed wait) does not outlive the fixture
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    if any(code for code, _ in story.first.values()):
        return story
    for name in procs:
        story.published[name] = sorted(p.name for p in (runs / name / "weights" / "step_4").iterdir())
        story.released[name] = httpx.get(
            f"{served.base}/prime_rl/adapters", auth=Signed(tenant.key_for(name), name)
        ).json()["adapters"]

    # The two trained adapters, loaded by the owner to compare them, then unloaded (the server holds
    # two at most, and alice needs hers back).
    checks = {name: f"check-{name}" for name in procs}
    for name, check in checks.items():
        body = {"name": check, "owner": "test", "path": str(runs / name / "weights" / "step_4"), "step": 4}
        assert httpx.post(f"{served.base}/prime_rl/load_adapter", json=body, auth=owner).status_code == 200
    story.scores = {name: scored(served.base, check, owner) for name, check in checks.items()}
    story.scores["base"] = scored(served.base, served.model, owner)
    for check in checks.values():
        body = {"name": check, "owner": "test"}
        assert httpx.post(f"{served.base}/prime_rl/unload_adapter", json=body, auth=owner).status_code == 200

    # Alice goes on alone from her checkpoint; bob attacks her adapter while she trains.
    alice = subprocess.Popen([RL, "@", str(runs / "alice.toml"), "--max-steps", "8"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env("alice"))  # fmt: skip
    bob = httpx.Client(base_url=served.base, timeout=60, auth=Signed(tenant.key_for("bob"), "bob"))
    try:
        story.attack = attack(bob, runs / "alice", served.model, alice)
        out, _ = alice.communicate(timeout=900)
        story.again = (alice.returncode, out)
        # Alice released her name at her end: now anyone may claim it.
        story.after["claim"] = bob.post(
            "/prime_rl/load_adapter", json={"name": "alice", "owner": "x"}
        ).status_code
        story.after["release"] = bob.post(
            "/prime_rl/unload_adapter", json={"name": "alice", "owner": "x"}
        ).json()
    finally:
        bob.close()
        if alice.poll() is None:
            alice.kill()
            alice.communicate()
    return story


def attack(bob: httpx.Client, alice_run: Path, base_model: str, alice: subprocess.Popen) -> dict[str, int]:
    """The review's run B, step by step, once alice holds her adapter's name on the server (she has
    published a step of her own): unload her adapter, claim its name, sample from it, list it, push
    base weights, vLLM's own adapter routes; and what B may do, sample the base model."""
    deadline = time.monotonic() + 600
    while not (alice_run / "weights" / "step_5" / "READY").exists():
        if alice.poll() is not None:
            return {"alice ended first": alice.returncode}
        assert time.monotonic() < deadline, "alice published no step"
        time.sleep(0.5)
    step_5 = str(alice_run / "weights" / "step_5")
    sample = {"model": "alice", "prompt": "hello", "max_tokens": 2}
    return {
        "unload": bob.post("/prime_rl/unload_adapter", json={"name": "alice", "owner": "x"}).status_code,
        "claim": bob.post(
            "/prime_rl/load_adapter", json={"name": "alice", "owner": "x", "path": step_5, "step": 5}
        ).status_code,
        "sample": bob.post("/v1/completions", json=sample).status_code,
        "list": len(bob.get("/prime_rl/adapters").json()["adapters"]),
        "load_weights": bob.post("/prime_rl/load_weights", json={"path": step_5, "step": 5}).status_code,
        "vllm_lora": bob.post(
            "/v1/load_lora_adapter", json={"lora_name": "alice", "lora_path": step_5}
        ).status_code,
        "metrics": bob.get("/metrics").status_code,
        "sample_base": bob.post("/v1/completions", json={**sample, "model": base_model}).status_code,
    }


def test_two_runs_train_their_own_adapters_on_one_server_and_one_resumes_alone(story):
    for name, (code, out) in story.first.items():
        assert code == 0, f"{name}:\n{out[-4000:]}"
    for name in story.first:
        run = story.runs / name
        trainer, orch = metrics(run, "trainer"), metrics(run, "orchestrator")
        assert [m["step"] for m in trainer[:4]] == list(range(4))
        assert [m["policy_version"] for m in orch[:4]] == [0, 1, 2, 3]  # each step's adapter sampled
        # Each run samples from its own adapter: the sampler's logprobs are the trainer's.
        assert max(m["mismatch_kl/all/mean"] for m in trainer) < 1e-2, [
            m["mismatch_kl/all/mean"] for m in trainer
        ]
        assert "adapter_model.safetensors" in story.published[name]  # an adapter, not the model
        assert "model.safetensors" not in story.published[name]
        assert story.released[name] == {}  # each released its name at the end
    # The two trained adapters differ from each other and from the base model.
    a, b, base = story.scores["alice"], story.scores["bob"], story.scores["base"]
    assert not torch.allclose(a, b, atol=1e-3) and not torch.allclose(a, base, atol=1e-3)
    # Alice went on alone from her checkpoint.
    code, out = story.again
    assert code == 0, out[-4000:]
    trainer = metrics(story.runs / "alice", "trainer")
    assert [m["step"] for m in trainer] == list(range(8))
    assert [m["policy_version"] for m in metrics(story.runs / "alice", "orchestrator")] == list(range(8))
    assert max(m["mismatch_kl/all/mean"] for m in trainer[4:]) < 1e-2


def test_another_tenant_cannot_touch_a_tenants_adapter_or_the_base_weights(story):
    assert story.again[0] == 0, story.again[1][-4000:]
    assert story.attack == {
        "unload": 409,  # not its adapter (naming no run)
        "claim": 409,
        "sample": 403,  # not an adapter it holds
        "list": 0,  # it sees only its own
        "load_weights": 403,  # the owner's routes
        "vllm_lora": 403,
        "metrics": 403,
        "sample_base": 200,  # what a tenant may do
    }
    assert story.after["claim"] == 200 and story.after["release"]["released"]
    # Alice's keys are her own: her run secret is not the server's, so bob (or the owner) derives
    # none of her transport or checkpoint keys from what he holds.
    assert story.own_secret
