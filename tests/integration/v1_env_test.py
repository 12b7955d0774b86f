"""A verifiers.v1 env's rollouts against a real vLLM server: the tokens verifiers' v1 message graph
records become training samples holding exactly what the server rendered and sampled."""

from pathlib import Path

import pytest
import torch
from token_checks import check_exact, rollouts_of
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.orchestrator.config import SamplingConfig
from prime_rl.orchestrator.v1_env import V1Env

pytestmark = pytest.mark.slow

MODEL = Path(__file__).resolve().parents[2] / "models" / "sum_digits-tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory, start_vllm):
    with start_vllm(MODEL, tmp_path_factory.mktemp("v1-inference"), 256) as s:
        yield s


def test_a_v1_rollout_trains_on_the_exact_tokens_of_its_model_call(served):
    sampling = SamplingConfig(temperature=1.0, max_tokens=24)
    rollouts, _, env = rollouts_of(served, "sum-digits-v1", sampling, 1)
    assert isinstance(env.vf_env, V1Env) and len(rollouts) == 8
    hf = (
        AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32),
        AutoTokenizer.from_pretrained(MODEL),
    )
    for r in rollouts:
        assert len(r.turns) == 1 and r.completion[-1]["role"] == "assistant"
        assert r.reward == r.metrics["correct_answer"] and "answer_format" in r.metrics
        check_exact(r, None, hf)
