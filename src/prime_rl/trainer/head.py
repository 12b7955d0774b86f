"""A transformer body with a linear head that gives one scalar per position: the critic's values
and the reward model's scores are the same module (`ScalarHead`), built by `model.build_model`.

Invariant: the head's first weights are drawn from a generator of their own (`seed`), so every
rank, and a resumed run before its checkpoint loads, starts from the same head; the output is a
float32 copy, never a view (FSDP2 hooks backward onto the output, which a view could bypass).
"""

from __future__ import annotations

import torch


class ScalarHead(torch.nn.Module):
    def __init__(self, body: torch.nn.Module, hidden_size: int, *, bias: bool, seed: int, std: float):
        super().__init__()
        self.body = body
        self.head = torch.nn.Linear(hidden_size, 1, bias=bias)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(1, hidden_size, generator=g) * std)
            if bias:
                self.head.bias.zero_()

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, **model_kwargs) -> torch.Tensor:
        """One scalar per packed position [N] (of the sequence up to and including it), for packed
        positions of shape [N]; `model_kwargs` go to the body (a context-parallel shard's plan)."""
        hidden = self.body(
            input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, **model_kwargs
        )
        return self.head(hidden.last_hidden_state[0]).squeeze(-1).to(torch.float32, copy=True)
