"""`engine/policy_logprobs.py` on vLLM's own sampler: the logprobs returned are the model's at each
request's temperature, whatever sampling settings banned; the tokens are sampled as before; and the
server runs vLLM in the mode each `inference.logprobs` choice needs."""

import pytest
import torch

from prime_rl.engine import policy_logprobs
from prime_rl.engine.server import server_command, server_env
from prime_rl.inference.config import InferenceConfig

VOCAB = 11


def metadata(temperature: list[float], banned: torch.Tensor | None = None, logprobs: int = 2):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    n = len(temperature)
    greedy = [t < 1e-5 for t in temperature]
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=None,
        top_k=None,
        generators={},
        max_num_logprobs=logprobs,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n),
        repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)],
        allowed_token_ids_mask=banned,  # True: the token may not be sampled (as for min_tokens' stops)
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    """vLLM's sampler ranks tokens through `torch.compile`; compiling leaves inductor's worker
    threads behind (and takes seconds). The servers run it eagerly on CPU too."""
    monkeypatch.setattr(torch._dynamo.config, "disable", True)


@pytest.fixture
def sampler(monkeypatch):
    """vLLM's sampler with the policy's logprobs installed (undone after the test)."""
    from vllm.v1.sample.sampler import Sampler

    monkeypatch.setattr(Sampler, "forward", Sampler.forward)
    policy_logprobs.install()
    return Sampler(logprobs_mode="raw_logprobs")


def test_logprobs_are_the_models_at_each_requests_temperature_despite_banned_tokens(sampler):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    temperature = [2.0, 0.7, 0.0]  # the last request greedy
    banned = torch.zeros(3, VOCAB, dtype=torch.bool)
    top = logits.argmax(-1)
    banned[torch.arange(3), top] = True  # each request's likeliest token banned
    out = sampler(logits.clone(), metadata(temperature, banned))
    sampled = out.sampled_token_ids[:, 0].long()
    assert not banned[torch.arange(3), sampled].any()  # sampling still obeys the ban
    scale = torch.tensor([2.0, 0.7, 1.0]).unsqueeze(1)  # greedy: the model's own distribution
    expected = torch.log_softmax(logits / scale, dim=-1)
    lp = out.logprobs_tensors
    ids = lp.logprob_token_ids.long()
    assert torch.equal(ids[:, 0], sampled)
    assert torch.allclose(lp.logprobs, expected.gather(1, ids), atol=1e-5)
    # The top-2 are the model's, the banned token first; ranks count every likelier token.
    assert torch.equal(ids[:, 1], top)
    ranks = (expected > expected.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(lp.selected_token_ranks.long(), ranks)


def test_without_it_vllm_returns_the_banned_distributions_logprobs(monkeypatch):
    """What 'sampler' returns, and what the trainer's ratio would have measured as a mismatch."""
    from vllm.v1.sample.sampler import Sampler

    torch.manual_seed(0)
    logits = torch.randn(1, VOCAB) * 3
    banned = torch.zeros(1, VOCAB, dtype=torch.bool)
    banned[0, logits.argmax()] = True
    out = Sampler(logprobs_mode="processed_logprobs")(logits.clone(), metadata([1.0], banned))
    token = out.sampled_token_ids[0, 0]
    policy = torch.log_softmax(logits[0], dim=-1)[token]
    assert out.logprobs_tensors.logprobs[0, 0] > policy + 0.1  # the banned mass spread over the rest


def test_the_server_runs_vllm_in_the_mode_each_choice_needs(tmp_path):
    for choice, mode in (("policy", "raw_logprobs"), ("sampler", "processed_logprobs")):
        config = InferenceConfig(output_dir=tmp_path, logprobs=choice)
        cmd = server_command(config, cpu_build=True)
        assert cmd[cmd.index("--logprobs-mode") + 1] == mode
        assert server_env(config, base={})[policy_logprobs.ENV] == choice
    assert InferenceConfig(output_dir=tmp_path).logprobs == "policy"
