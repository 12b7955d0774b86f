"""Per-token logprobs and entropies of packed sequences.

Invariant: arrays are aligned to tokens. Entry t holds log p(token t | tokens before it in the same
sample), from the logits at t - 1 divided by the sampling temperature; entry 0 of the micro-batch
has no prediction and is 0 (it is always a prompt token, never in the loss). Samples do not attend
to each other: transformers builds a block-diagonal causal mask from position ids that restart at 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def forward_logprobs(
    model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy), each of shape [T], for one packed micro-batch of shape [T]."""
    logits = model(input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False).logits[0]
    logits = logits[:-1].float() / temperature
    logp = F.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, input_ids[1:, None].long()).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    zero = token_logp.new_zeros(1)
    return torch.cat([zero, token_logp]), torch.cat([zero, entropy.detach()])
