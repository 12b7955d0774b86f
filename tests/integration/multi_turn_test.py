"""Multi-turn rollouts against a real vLLM server, token-in: every turn's prompt extends the tokens the
model saw, so a rollout trains as one sample holding exactly the tokens the server received and
sampled on each turn (checked on the wire, and by re-scoring the sample with the HF model), env
tokens with loss mask 0, even under a chat template that rewrites earlier turns."""

from pathlib import Path

import pytest
import torch
from token_checks import check_exact, rollouts_of
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers.templates import QWEN3_LIKE, THINK, renderer_with
from prime_rl.orchestrator.envs.renderer import Renderer
from prime_rl.orchestrator.envs_config import SamplingConfig
from prime_rl.orchestrator.loop.samples import rollout_to_samples, turn_stats

pytestmark = pytest.mark.slow

MODEL = Path(__file__).resolve().parents[2] / "models" / "digit_sum_feedback-tiny"


@pytest.fixture
def served(digit_sum_server):
    return digit_sum_server  # MODEL


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32), AutoTokenizer.from_pretrained(
        MODEL
    )


@pytest.fixture
def rewriting(tmp_path) -> Renderer:
    """MODEL's tokenizer with the history-rewriting template (the server needs no template: the
    orchestrator sends token ids)."""
    return renderer_with(MODEL, QWEN3_LIKE, tmp_path / "tokenizer")


def test_a_three_turn_rollout_is_one_sample_with_the_exact_tokens_of_each_turn(served, hf):
    sampling = SamplingConfig(temperature=1.0, max_tokens=24)

    def has_three_turns(rollouts):
        return any(len(r.turns) == 3 for r in rollouts)

    rollouts, wire = rollouts_of(served, "digit-sum-feedback", sampling, 6, until=has_three_turns)
    assert has_three_turns(rollouts)
    for r in rollouts:
        assert turn_stats(r).samples == 1 and r.drifted_turns == 0  # ChatML keeps history as it was
        check_exact(r, wire, hf)
    three = next(r for r in rollouts if len(r.turns) == 3)
    assert turn_stats(three).env_tokens > 0 and [m["role"] for m in three.completion] == [
        "assistant", "user", "assistant", "user", "assistant",
    ]  # fmt: skip


def test_five_turns_under_a_history_rewriting_template_train_as_one_exact_sample(served, hf, rewriting):
    sampling = SamplingConfig(temperature=1.0, max_tokens=16)
    rollouts, wire = rollouts_of(
        served, "turns-env", sampling, 1, size=4, renderer=rewriting, args={"turns": 5}
    )
    for r in rollouts:
        assert len(r.turns) == 5
        # One sample per rollout (samples_per_rollout 1.0), though the template rewrote history at
        # each of the four later turns: re-rendering would have split it into five.
        assert turn_stats(r).samples == 1 and r.drifted_turns == 4
        check_exact(r, wire, hf, renderer=rewriting)  # logprobs to 1e-3 under the HF model
        # The trainer's tokens: O(turns), the last turn's context once, not every turn's again.
        (sample,) = rollout_to_samples(r, 1.0)
        assert len(sample) == len(r.turns[-1].prompt_ids) + len(r.turns[-1].completion_ids)
        assert sum(len(t.prompt_ids) + len(t.completion_ids) for t in r.turns) > 2.5 * len(sample)
        assert THINK in rewriting.decode(sample.prompt_ids)
