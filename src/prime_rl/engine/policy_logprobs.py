"""vLLM returns each sampled token's logprob under the policy: the model's distribution at the
request's temperature, before any sampling setting that bans, truncates or reshapes it.

The trainer's importance ratio divides its own logprobs (the model at the sampling temperature) by
the sampler's. vLLM offers either unscaled logprobs (`raw_logprobs`: wrong at any temperature but 1)
or those of the distribution tokens were drawn from (`processed_logprobs`: after `min_tokens`, top-k,
top-p, min-p, penalties and logit bias as well). With the latter, a setting the user chose becomes
a mismatch the trainer corrects for: `min_tokens = 100` on a model that wants to stop puts the
ratio at 1 - p(end of turn) for every forced token, and on reverse-text the trust mask then dropped
39% of the loss tokens of the first step. Here the engine keeps vLLM's `raw_logprobs` flow and
scales the logits by each request's temperature first (`inference.logprobs = "policy"`).

Invariant: with `PRIME_RL_LOGPROBS=policy` in the environment of the process that samples (vLLM's
worker, or its engine core when that runs the model), and vLLM run with `--logprobs-mode
raw_logprobs`, every returned logprob (sampled and top-k) is log softmax(logits / T) of its request's
temperature T (1 for greedy requests), with vLLM's own ranks; nothing else about sampling changes.
"""

from __future__ import annotations

import os

ENV = "PRIME_RL_LOGPROBS"
"""Set to "policy" in the environment of vLLM's processes to install this on import."""

_GREEDY_EPS = 1e-5
"""vLLM's threshold below which a temperature means greedy sampling (`_SAMPLING_EPS`)."""


def install() -> None:
    """Wrap vLLM's `Sampler.forward` (once per process)."""
    from vllm.v1.sample.sampler import Sampler

    if getattr(Sampler.forward, "prime_rl_policy", False):
        return
    forward = Sampler.forward

    def policy_forward(
        self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None
    ):
        mode = logprobs_mode_override or self.logprobs_mode
        wanted = sampling_metadata.max_num_logprobs is not None or bool(sampling_metadata.logprob_token_ids)
        if not wanted or predict_bonus_token or mode != "raw_logprobs":
            return forward(self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override)
        import torch

        temperature = sampling_metadata.temperature
        if temperature is None:  # every request greedy
            temperature = torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
        temperature = torch.where(temperature < _GREEDY_EPS, 1.0, temperature.float()).unsqueeze(1)
        # Before vLLM's forward, which scales and masks the logits in place.
        normalizer = torch.logsumexp(logits.float() / temperature, dim=-1, keepdim=True)
        # The raw logits are gathered and ranked as the raw logprobs would be (same order per row).
        out = forward(self, logits, sampling_metadata, predict_bonus_token, "raw_logits")
        gathered = out.logprobs_tensors
        if gathered is not None:
            out.logprobs_tensors = gathered._replace(logprobs=gathered.logprobs / temperature - normalizer)
        return out

    policy_forward.prime_rl_policy = True
    Sampler.forward = policy_forward


def install_if_asked() -> None:
    """`install()` where the environment asks for the policy's logprobs (see the module invariant)."""
    if os.environ.get(ENV) == "policy":
        install()
