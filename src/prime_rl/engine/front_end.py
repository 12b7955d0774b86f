"""vLLM's front end (the API server, or the orchestrator in engine mode) without a tokenizer decode per
sampled token. The front end turns every engine step's outputs into answers, on the Python thread
that also runs the rollouts (engine mode) or the HTTP server, so its per-token costs are a step's
bound on a small machine (profiled on 2 cores: the orchestrator's main thread 71% busy during
generation of 100-token completions, three quarters of that in vLLM's output path).

Every logprob carries its token's text, which vLLM decodes one id at a time through the tokenizer
(`convert_ids_list_to_tokens`, via its tokenizer pool's queue and transformers' decode) on every
engine step of every request: 12,800 decodes per step of 128 rollouts x 100 tokens. A single id's
text depends on the id and the tokenizer only, so here it is decoded once per tokenizer and then
read from a dict.

Invariant: the answers are vLLM's own (the cached text is, element by element, what vLLM's function
returns for the same tokenizer and ids); where vLLM's module no longer has the function, nothing is
installed.
"""

from __future__ import annotations

from collections.abc import Callable

CACHE_ATTR = "_prime_rl_token_text"
"""The tokenizer's attribute holding its id -> text dict (a vocabulary's worth at most)."""


def cached(convert: Callable) -> Callable:
    """`convert` (vLLM's `convert_ids_list_to_tokens(tokenizer, ids)`), remembering each id's text."""

    def convert_cached(tokenizer, token_ids):
        cache = getattr(tokenizer, CACHE_ATTR, None)
        if cache is None:
            cache = {}
            setattr(tokenizer, CACHE_ATTR, cache)
        new = [t for t in dict.fromkeys(token_ids) if t not in cache]
        if new:
            cache.update(zip(new, convert(tokenizer, new), strict=True))
        return [cache[t] for t in token_ids]

    convert_cached.prime_rl_uncached = convert
    return convert_cached


def cache_token_text() -> bool:
    """Install the cache in vLLM's logprobs processor (this process's front end); True if it is."""
    try:
        from vllm.v1.engine import logprobs
    except ImportError:
        return False
    convert = getattr(logprobs, "convert_ids_list_to_tokens", None)
    if convert is None:
        return False
    if not hasattr(convert, "prime_rl_uncached"):
        logprobs.convert_ids_list_to_tokens = cached(convert)
    return True
