"""LoRA through a real vLLM server: the trainer's published adapter, loaded by the orchestrator's
weight sync under the run's name, gives the trainer's logprobs; names belong to one run; a server
without LoRA is refused in one line."""

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
import torch

from prime_rl.orchestrator.config import ClientConfig
from prime_rl.orchestrator.loop.servers import ServerPool
from prime_rl.orchestrator.loop.weights import Adapter, AdapterRefused, WeightSync, request_model
from prime_rl.runtime import secret
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.rl.trainer import Trainer
from prime_rl.trainer.weights.publish import Publisher

sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
from grad_worker import rank_micro_batches

pytestmark = pytest.mark.slow

PROMPTS = ["reverse: hello", "reverse: abcdef", "reverse: prime rl", "reverse: zyx"]


def sample(base: str, model: str, n: int = 4) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """(prompt ids, completion ids, served logprobs) of `n` completions of each prompt."""
    out = []
    for prompt in PROMPTS:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "n": n,
                "temperature": 1.0, "logprobs": True, "return_token_ids": True, "seed": 1}  # fmt: skip
        reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120).json()
        for choice in reply["choices"]:
            lps = torch.tensor([t["logprob"] for t in choice["logprobs"]["content"]])
            out.append((reply["prompt_token_ids"], choice["token_ids"], lps))
    return out


def mismatch_kl(model: torch.nn.Module, samples) -> float:
    """Mean k3 estimate of KL(sampler || trainer) per completion token, as the trainer logs it."""
    terms = []
    for prompt, completion, served in samples:
        ids = prompt + completion
        with torch.no_grad():
            lp = forward_logprobs(model, torch.tensor(ids), torch.arange(len(ids)))[0][len(prompt) :]
        d = lp - served
        terms.append(torch.exp(d) - 1 - d)
    return torch.cat(terms).mean().item()


def test_the_served_adapter_gives_the_trainers_logprobs(lora_server, tiny_model, start_vllm):
    served, runs = lora_server
    out = runs / "run-a"
    config = TrainerConfig(model={"name": str(tiny_model)}, lora={"rank": 8, "alpha": 16.0}, seq_len=128,
                           output_dir=out, optim={"lr": 3e-2})  # fmt: skip
    world = World()
    trainer = Trainer(config, world)
    trainer.model.eval()
    publisher = Publisher(out, str(tiny_model), world, keep=3, lora=config.lora)
    pool = ServerPool(ClientConfig(base_urls=[f"{served.base}/v1"]))
    sync = WeightSync(out / "weights", pool, adapter=Adapter("run-a", str(out)))

    async def claim_and_poll() -> int:
        await sync.claim()
        return await sync.poll()

    assert asyncio.run(claim_and_poll()) == 0
    # Version 0 asks for the base model, which the untrained adapter equals.
    assert request_model(served.model, "run-a", 0) == served.model
    assert mismatch_kl(trainer.model, sample(served.base, served.model)) < 1e-3
    base_samples = sample(served.base, served.model)

    for version in (1, 2):
        for seed in range(2):
            trainer.train_step(rank_micro_batches(world, 0, seed + 10 * version), seed)
        publisher.publish(trainer.model, version)
        publisher.wait()
        assert asyncio.run(sync.poll()) == version
        adapter = request_model(served.model, "run-a", version)
        assert adapter == "run-a"
        assert mismatch_kl(trainer.model, sample(served.base, adapter)) < 1e-3
        # The adapter is not the base model: the base model's own samples score differently.
        assert mismatch_kl(trainer.model, base_samples) > 1e-2
    # `export-lora` of the last step: vLLM serves the merged model, without LoRA, as the trainer's.
    from prime_rl.trainer.weights.export_lora import main as export_lora

    export_lora(["--adapter", str(out / "weights" / "step_2"), "--output", str(runs / "merged")])
    with start_vllm(runs / "merged", runs / "merged-inference", 256) as merged:
        assert mismatch_kl(trainer.model, sample(merged.base, merged.model)) < 1e-3
    mine = {secret.OWNER_HEADER: str(out)}  # the run's owner token (here the test's own string)
    assert httpx.get(f"{served.base}/prime_rl/adapters", headers=mine).json()["adapters"] == {
        "run-a": {"step": 2}
    }
    assert httpx.get(f"{served.base}/prime_rl/adapters").json()["adapters"] == {}  # others see nothing
    asyncio.run(sync.release())
    assert "run-a" not in httpx.get(f"{served.base}/prime_rl/adapters", headers=mine).json()["adapters"]


def test_a_name_belongs_to_one_run_and_paths_are_checked(lora_server):
    served, runs = lora_server

    def load(**body):
        return httpx.post(f"{served.base}/prime_rl/load_adapter", json=body, timeout=30)

    assert load(name="shared", owner="/runs/x").status_code == 200
    taken = load(name="shared", owner="/runs/y")
    assert taken.status_code == 409 and "/runs/x" not in taken.json()["error"]  # the owner stays private
    pool = ServerPool(ClientConfig(base_urls=[f"{served.base}/v1"]))
    sync = WeightSync(runs / "y" / "weights", pool, adapter=Adapter("shared", "/runs/y"))
    with pytest.raises(AdapterRefused, match=r"orchestrator.lora_adapter = 'shared'.*used by another run"):
        asyncio.run(sync.claim())
    assert load(name="shared", owner="/runs/x", path="/tmp", step=1).status_code == 403
    folder = runs / "x" / "weights" / "step_1"
    folder.mkdir(parents=True)
    assert load(name="shared", owner="/runs/x", path=str(folder), step=1).status_code == 404  # no READY
    (folder / "READY").touch()
    assert load(name="shared", owner="/runs/x", path=str(folder), step=1).status_code == 422  # no adapter
    assert load(name=served.model, owner="/runs/x").status_code == 409  # the base model's name
    assert load(owner="/runs/x").status_code == 400
    release = {"name": "shared", "owner": "/runs/x"}
    assert httpx.post(f"{served.base}/prime_rl/unload_adapter", json=release).json()["released"]
    assert load(name="shared", owner="/runs/y").status_code == 200  # free again
    release = {"name": "shared", "owner": "/runs/y"}  # the server is shared: leave it as found
    assert httpx.post(f"{served.base}/prime_rl/unload_adapter", json=release).json()["released"]


def test_a_lora_run_against_a_server_without_lora_is_refused(server, tmp_path):
    pool = ServerPool(ClientConfig(base_urls=[f"{server.base}/v1"]))
    sync = WeightSync(tmp_path / "weights", pool, adapter=Adapter("run-a", str(tmp_path)))
    with pytest.raises(AdapterRefused, match=r"orchestrator.lora_adapter = 'run-a'.*started without LoRA"):
        asyncio.run(sync.claim())


def test_the_orchestrator_of_a_lora_run_stops_in_one_line_on_a_server_without_lora(server, tmp_path):
    import subprocess

    cmd = [str(Path(sys.executable).parent / "orchestrator"), "--model.name", server.model,
           "--lora-adapter", "run-a", "--client.base-urls", f'["{server.base}/v1"]',
           "--output-dir", str(tmp_path / "run"), "--transport.type", "filesystem"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]  # a restart would fail the same way
    errors = [line for line in proc.stderr.splitlines() if line.startswith("orchestrator: error:")]
    assert errors == [
        f"orchestrator: error: orchestrator.lora_adapter = 'run-a': {server.base} refused it: "
        "this server was started without LoRA: start it with [inference.lora]"
    ], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
