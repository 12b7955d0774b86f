"""The orchestrator as users run it (`orchestrator @ file.toml`) against a real vLLM server and the
real reverse-text env; the test is the trainer end: a zmq PULL socket receiving micro-batches."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from prime_rl.net import free_port
from prime_rl.transport.zmq_transport import ZmqReceiver

pytestmark = pytest.mark.slow


def test_orchestrator_streams_micro_batches_from_real_rollouts(server, tmp_path):
    base, model, _ = server
    port = free_port()
    out = tmp_path / "run"
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
            mbs.append(receiver.recv())
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
