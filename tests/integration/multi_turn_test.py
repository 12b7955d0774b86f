"""Multi-turn rollouts against a real vLLM server: every training sample holds exactly the tokens the
server received and sampled on each turn (checked on the wire, and by re-scoring the sample with the
HF model), env tokens carry loss mask 0, and a chat template that re-renders earlier turns
differently splits the rollout into one sample per turn instead of training on re-tokenized text."""

from pathlib import Path

import pytest
import torch
from token_checks import check_exact, rollouts_of
from transformers import AutoModelForCausalLM, AutoTokenizer

from prime_rl.model.tiny import CHAT_TEMPLATE
from prime_rl.orchestrator.envs_config import SamplingConfig
from prime_rl.orchestrator.loop.samples import turn_stats

pytestmark = pytest.mark.slow

MODEL = Path(__file__).resolve().parents[2] / "models" / "digit_sum_feedback-tiny"

# As Qwen3's template does for turns without reasoning: earlier assistant turns are re-rendered with
# an empty think block that the model never sampled, so a later prompt does not extend the earlier one.
THINK_TEMPLATE = CHAT_TEMPLATE.replace(
    "{{- '<|im_start|>' + message['role'] + '\\n' }}",
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}",
)


@pytest.fixture
def served(digit_sum_server):
    return digit_sum_server  # MODEL, accepting the request's chat template


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32), AutoTokenizer.from_pretrained(
        MODEL
    )


def test_a_three_turn_rollout_is_one_sample_with_the_exact_tokens_of_each_turn(served, hf):
    sampling = SamplingConfig(temperature=1.0, max_tokens=24)

    def has_merged_three_turns(rollouts):
        return any(len(r.turns) == 3 and turn_stats(r).samples == 1 for r in rollouts)

    rollouts, wire, _ = rollouts_of(served, "digit-sum-feedback", sampling, 6, until=has_merged_three_turns)
    assert has_merged_three_turns(rollouts)
    for r in rollouts:
        check_exact(r, wire, hf, None)
    merged = next(r for r in rollouts if len(r.turns) == 3 and turn_stats(r).samples == 1)
    assert turn_stats(merged).env_tokens > 0 and [m["role"] for m in merged.completion] == [
        "assistant", "user", "assistant", "user", "assistant",
    ]  # fmt: skip


def test_a_template_that_rerenders_earlier_turns_gives_one_sample_per_turn(served, hf):
    sampling = SamplingConfig(temperature=1.0, max_tokens=24, extra_body={"chat_template": THINK_TEMPLATE})
    rollouts, wire, _ = rollouts_of(served, "digit-sum-feedback", sampling, 2)
    multi = [r for r in rollouts if len(r.turns) > 1]
    assert multi, "no multi-turn rollout in 16"
    for r in rollouts:
        assert turn_stats(r).samples == len(r.turns)  # never merged across a re-rendered turn
        check_exact(r, wire, hf, THINK_TEMPLATE)
