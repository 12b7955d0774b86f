"""vLLM's front end sped up: the sampled tokens' text in its logprobs comes from a per-tokenizer cache
that answers what vLLM's own one-id-at-a-time decode answers, and its settings are read once."""

from prime_rl.engine.front_end import cache_token_text, cached


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
    try:
        assert cache_token_text()
        installed = logprobs.convert_ids_list_to_tokens
        assert installed.prime_rl_uncached is original
        assert cache_token_text() and logprobs.convert_ids_list_to_tokens is installed  # not twice
    finally:
        logprobs.convert_ids_list_to_tokens = original
