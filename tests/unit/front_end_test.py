"""vLLM's front end sped up: the sampled tokens' text in its logprobs comes from a per-tokenizer cache
that answers what vLLM's own one-id-at-a-time decode answers, and a step's sampled logprobs are
collected in one pass into what vLLM's own method collects."""

import numpy as np
import pytest

from prime_rl.engine.front_end import cached, collected, speed_up_front_end


def test_cached_text_is_vllms_for_every_id_and_each_id_is_decoded_once(tiny_model):
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.tokenizers.registry import get_tokenizer

    tokenizer = get_tokenizer(str(tiny_model))
    ids = list(range(len(tokenizer)))
    decoded: list[int] = []

    def counting(tok, token_ids):
        decoded.extend(token_ids)
        return convert_ids_list_to_tokens(tok, token_ids)

    convert = cached(counting)
    assert convert(tokenizer, ids) == convert_ids_list_to_tokens(tokenizer, ids)
    assert sorted(decoded) == ids
    decoded.clear()
    assert convert(tokenizer, [5, 5, 7]) == convert_ids_list_to_tokens(tokenizer, [5, 5, 7])
    assert decoded == []  # all from the cache
    other = get_tokenizer(str(tiny_model))  # a cache per tokenizer, not shared by id alone
    assert convert(other, [5]) == convert_ids_list_to_tokens(other, [5]) and decoded == [5]


def test_installed_once_in_vllms_logprobs_processor():
    from vllm.v1.engine import logprobs

    original = logprobs.convert_ids_list_to_tokens
    update = logprobs.LogprobsProcessor._update_sample_logprobs
    try:
        assert speed_up_front_end()
        installed = logprobs.convert_ids_list_to_tokens
        assert installed.prime_rl_uncached is original
        collecting = logprobs.LogprobsProcessor._update_sample_logprobs
        assert collecting.prime_rl_original is update
        assert speed_up_front_end() and logprobs.convert_ids_list_to_tokens is installed  # not twice
        assert logprobs.LogprobsProcessor._update_sample_logprobs is collecting
    finally:
        logprobs.convert_ids_list_to_tokens = original
        logprobs.LogprobsProcessor._update_sample_logprobs = update


def _collect(update, tokenizer, steps, num_logprobs, flat=False):
    """What `update` collects over `steps` (each a request's LogprobsLists per engine step)."""
    from vllm.logprobs import create_sample_logprobs
    from vllm.v1.engine.logprobs import LogprobsProcessor

    procs = [
        LogprobsProcessor(tokenizer=tokenizer, logprobs=create_sample_logprobs(flat), prompt_logprobs=None,
                          cumulative_logprob=0.0, num_logprobs=num_logprobs, num_prompt_logprobs=None)
        for _ in steps[0]
    ]  # fmt: skip
    for step in steps:
        for proc, lists in zip(procs, step, strict=True):
            update(proc, lists)
    entries = [
        [[(k, type(k), v.logprob, type(v.logprob), v.rank, type(v.rank), v.decoded_token) for k, v in d.items()]
         for d in proc.logprobs]
        for proc in procs
    ]  # fmt: skip
    return entries, [proc.cumulative_logprob for proc in procs]


@pytest.mark.parametrize("num_logprobs", [0, 2])
def test_collected_logprobs_are_vllms_over_the_whole_vocabulary(tiny_model, num_logprobs):
    """Every id, byte-fallback ones included (their text ends in U+FFFD alone and is corrected from
    the preceding sampled ids), in 16 requests x 60 steps: the same entries, in the same order, with
    the same ranks, texts and types, and the same cumulative logprob."""
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.tokenizers.registry import get_tokenizer
    from vllm.v1.engine import logprobs
    from vllm.v1.outputs import LogprobsLists

    tokenizer = get_tokenizer(str(tiny_model))
    vocab = len(tokenizer)
    texts = convert_ids_list_to_tokens(tokenizer, list(range(vocab)))
    assert any(t.endswith("\ufffd") for t in texts)  # the correction is exercised
    rng = np.random.default_rng(num_logprobs)
    k = num_logprobs + 1
    steps = [
        [LogprobsLists(rng.integers(0, vocab, size=(1, k)).astype(np.int32),
                       -rng.random((1, k)).astype(np.float32), rng.integers(1, vocab, size=(1,)))
         for _ in range(16)]
        for _ in range(60)
    ]  # fmt: skip
    original = logprobs.LogprobsProcessor._update_sample_logprobs
    assert not hasattr(original, "prime_rl_original")
    from vllm.logprobs import Logprob, append_logprobs_for_next_position

    fast = collected(original, cached(convert_ids_list_to_tokens), append_logprobs_for_next_position, Logprob)
    assert _collect(fast, tokenizer, steps, num_logprobs) == _collect(
        original, tokenizer, steps, num_logprobs
    )
    # Two positions in one step (speculative decoding's shape) and flat containers: the same, too.
    two = [[LogprobsLists(np.concatenate([a.logprob_token_ids, b.logprob_token_ids]),
                          np.concatenate([a.logprobs, b.logprobs]),
                          np.concatenate([a.sampled_token_ranks, b.sampled_token_ranks]))
            for a, b in zip(first, second, strict=True)]
           for first, second in zip(steps[::2], steps[1::2], strict=True)]  # fmt: skip
    assert _collect(fast, tokenizer, two, num_logprobs) == _collect(original, tokenizer, two, num_logprobs)
    flat = _collect(fast, tokenizer, steps[:5], num_logprobs, flat=True)
    assert flat == _collect(original, tokenizer, steps[:5], num_logprobs, flat=True)
