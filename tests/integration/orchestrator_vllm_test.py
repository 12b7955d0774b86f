"""The orchestrator as users run it (`orchestrator @ file.toml`) against a real vLLM server and the
real reverse-text env; the test is the trainer end: a zmq PULL socket receiving micro-batches."""

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from prime_rl.auth import clients
from prime_rl.runtime.net import free_port
from prime_rl.transport.messages import MicroBatch
from prime_rl.transport.zmq_transport import ZmqReceiver

pytestmark = pytest.mark.slow


def test_orchestrator_streams_micro_batches_from_real_rollouts(server, tmp_path):
    base, model, weights_dir = server
    port = free_port()
    # A run folder under the server's weights dir, which it loads from (checked at start-up); no
    # trainer publishes into it, so the server keeps its weights.
    out = weights_dir / f"orchestrator-{tmp_path.name}"
    toml = tmp_path / "orch.toml"
    toml.write_text(
        f"""
output_dir = "{out}"
max_steps = 2
max_async_level = 2
batch_size = 16
seq_len = 256

[model]
name = "{model}"

[client]
base_urls = ["{base}/v1"]

[transport]
port = {port}
run_id = "it"

[[envs]]
id = "reverse-text"
group_size = 4
state_columns = ["answer"]
sampling = {{ temperature = 1.0, max_tokens = 24 }}
"""
    )
    receiver = ZmqReceiver(f"tcp://127.0.0.1:{port}", "it", timeout_s=180)
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "orchestrator"), "@", str(toml)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        mbs = []
        while not (mbs and mbs[-1].header.step == 1 and mbs[-1].index == mbs[-1].count - 1):
            message = receiver.recv()
            if isinstance(message, MicroBatch):  # (the orchestrator's Hello comes first)
                mbs.append(message)
        output, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
        receiver.close()
    assert proc.returncode == 0, output
    assert "step 1 | reward" in output

    tok = AutoTokenizer.from_pretrained(model)
    trained_tokens = 0
    for mb in mbs:
        mb.validate(seq_len=256)
        arrays = mb.arrays()
        trained_tokens += int(arrays["loss_mask"].sum())
        assert (arrays["logprobs"][arrays["loss_mask"] == 1] <= 0).all()
        if mb.env_names == [""]:
            # A step whose groups were all filtered still sends one fully masked filler micro-batch.
            assert arrays["loss_mask"].sum() == 0
            continue
        # Each sample starts with the chat-templated prompt: the exact ids vLLM saw.
        first = arrays["input_ids"][: mb.sample_lens[0]].tolist()
        assert tok.decode(first).startswith("<|im_start|>system\nReverse the text")
    assert trained_tokens > 0

    records = [json.loads(line) for line in (out / "rollouts" / "step_000000.jsonl").read_text().splitlines()]
    assert len(records) >= 16 and all("answer" in r and r["policy_version"] == 0 for r in records)
    metrics = [json.loads(line) for line in (out / "orchestrator" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert (
            m["rollouts/all/dispatched_total"]
            == sum(m[f"rollouts/all/{b}_total"] for b in ("trained", "filtered", "failed", "stale"))
            + m["rollouts/all/inflight"]
            + m["rollouts/all/waiting"]
        )


def test_a_group_is_one_n_request_to_real_vllm_and_each_rollout_keeps_its_own_choice(server):
    import asyncio

    from token_checks import Wire

    from prime_rl.orchestrator.config import ClientConfig
    from prime_rl.orchestrator.envs.client import Clients
    from prime_rl.orchestrator.envs.group_runner import GroupRun, run_group
    from prime_rl.orchestrator.envs.load import load_env
    from prime_rl.orchestrator.envs.renderer import Renderer
    from prime_rl.orchestrator.envs_config import EnvConfig, SamplingConfig
    from prime_rl.orchestrator.loop.examples import ExampleSource

    base, model, _ = server
    sampling = SamplingConfig(temperature=2.0, max_tokens=8, extra_body={"min_tokens": 2})
    env = load_env(EnvConfig(id="reverse-text", group_size=8, sampling=sampling))
    example = ExampleSource(env.examples, 0).next()
    task = env.vf_env.task(example.task)
    url = f"{base}/v1"
    job = GroupRun(env.name, env.vf_env, task, example.example_id, 8, 0, sampling)

    async def go():
        wire = Wire(Clients(ClientConfig(base_urls=[url], timeout_s=60), model).get(url))
        try:
            return await run_group(job, wire, Renderer.for_model(model), model, 60.0), wire
        finally:
            await wire.close()

    rollouts, wire = asyncio.run(go())
    assert [len(choices) for _, choices in wire.seen] == [8]  # one request, n = 8
    # The server said which step it served when it answered: every rollout carries it.
    served = httpx.get(f"{base}/prime_rl/weights", auth=clients.auth()).json()["step"]
    assert {(r.turns[0].version, r.policy_span) for r in rollouts} == {(served, (0, served))}
    assert not [r.error for r in rollouts if r.failed]
    tok = AutoTokenizer.from_pretrained(model)
    messages = [
        {"role": "system", "content": task.data.system_prompt},
        {"role": "user", "content": task.data.prompt},
    ]
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    for r in rollouts:
        (turn,) = r.turns
        assert turn.prompt_ids == prompt_ids
        assert len(turn.completion_ids) == len(turn.completion_logprobs) >= 2
        # The tokens, their logprobs and the text scored by the reward are one choice's (the server
        # leaves out a trailing incomplete UTF-8 sequence from the text).
        text = tok.decode(turn.completion_ids, skip_special_tokens=True)
        assert text.rstrip("\ufffd") == r.completion[-1]["content"].rstrip("\ufffd")
    assert len({tuple(r.turns[0].completion_ids) for r in rollouts}) > 1  # 8 samples, not one copied


def test_a_teacher_identical_to_the_student_gives_zero_reverse_kl_on_real_vllm(server, tmp_path):
    """The teacher is the very server that sampled: its prompt logprobs of the sampled tokens equal the
    sampling logprobs (float32), so any misalignment of positions would show as a large KL."""
    import asyncio

    from prime_rl.orchestrator.config import ClientConfig
    from prime_rl.orchestrator.envs.client import Clients
    from prime_rl.orchestrator.envs.group_runner import GroupRun, run_group
    from prime_rl.orchestrator.envs.load import load_env
    from prime_rl.orchestrator.envs.renderer import Renderer
    from prime_rl.orchestrator.envs.teacher import Teacher
    from prime_rl.orchestrator.envs_config import EnvConfig, SamplingConfig, TeacherConfig
    from prime_rl.orchestrator.loop.examples import ExampleSource
    from prime_rl.orchestrator.loop.samples import rollout_to_samples

    base, model, _ = server
    sampling = SamplingConfig(temperature=1.0, max_tokens=12)
    env = load_env(EnvConfig(id="reverse-text", group_size=4, sampling=sampling))
    example = ExampleSource(env.examples, 0).next()
    task = env.vf_env.task(example.task)

    async def go():
        url = f"{base}/v1"
        clients = Clients(ClientConfig(base_urls=[url], timeout_s=60), model)
        job = GroupRun(env.name, env.vf_env, task, example.example_id, 4, 0, sampling)
        rollouts = await run_group(job, clients.get(url), Renderer.for_model(model), model, 60.0)
        await clients.aclose()
        teacher = Teacher(TeacherConfig(base_url=f"{base}/v1", model=model))
        await teacher.check()
        try:
            return await teacher.score_group(rollouts)
        finally:
            await teacher.aclose()

    scored = asyncio.run(go())
    assert len(scored) == 4 and not any(r.failed for r in scored)
    for r in scored:
        (turn,) = r.turns
        assert len(turn.teacher_logprobs) == len(turn.completion_ids) > 0
        assert turn.teacher_logprobs == pytest.approx(turn.completion_logprobs, abs=1e-3)
        assert abs(r.metrics["teacher_kl"]) < 1e-3
        (sample,) = rollout_to_samples(r, 0.0, distill_weight=1.0)
        assert max(abs(a) for a in sample.token_advantages) < 1e-3
