"""A verifiers.v1 env's multi-turn rollouts against a real vLLM server: the tokens verifiers' v1 message
graph records become training samples holding exactly what the server rendered and sampled on
each turn, the env's replies in between with loss mask 0."""

from pathlib import Path

import pytest
import torch
from token_checks import check_exact, rollouts_of
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.orchestrator.envs.v1_env import V1Env
from prime_rl.orchestrator.envs_config import SamplingConfig
from prime_rl.orchestrator.loop.samples import turn_stats

pytestmark = pytest.mark.slow

MODEL = Path(__file__).resolve().parents[2] / "models" / "digit_sum_feedback-tiny"


@pytest.fixture
def served(digit_sum_server):
    return digit_sum_server  # MODEL (the one the multi-turn tests use)


def test_a_multi_turn_v1_rollout_is_one_sample_with_the_exact_tokens_of_each_turn(served):
    sampling = SamplingConfig(temperature=1.0, max_tokens=24)

    def has_merged_turns(rollouts):
        return any(len(r.turns) >= 2 and turn_stats(r).samples == 1 for r in rollouts)

    rollouts, _, env = rollouts_of(served, "digit-sum-feedback-v1", sampling, 6, until=has_merged_turns)
    assert isinstance(env.vf_env, V1Env) and has_merged_turns(rollouts)
    hf = (
        AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32),
        AutoTokenizer.from_pretrained(MODEL),
    )
    for r in rollouts:
        assert r.reward == r.metrics["feedback_reward"]
        assert [m["role"] for m in r.completion] == ["assistant", "user"] * (len(r.turns) - 1) + ["assistant"]
        check_exact(r, None, hf)
