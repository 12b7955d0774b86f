"""Per-token logprobs and entropies of packed sequences, without ever holding the vocabulary's logits.

Invariant: arrays are aligned to tokens. Entry t holds log p(token t | tokens before it in the same
sample), from the logits at t - 1 divided by the sampling temperature; entry 0 of the micro-batch
has no prediction and is 0 (it is always a prompt token, never in the loss). A micro-batch's pass
(`batch_logprobs`) computes its loss tokens only and leaves the others 0. Samples do not attend
to each other: position ids restart at 0 for each one, and attention is block-diagonal causal.

Memory: the lm_head is applied to `chunk_tokens` hidden states at a time (default: CHUNK_LOGITS
logits' worth), in forward and again in
backward (`ChunkedTokenLogprobs` recomputes each chunk's logits instead of saving them), so the
logits held at once are chunk_tokens x vocabulary, whatever the micro-batch's length. At a real
vocabulary (151,936) the full [tokens x vocab] float logits of a 4k micro-batch are 2.5 GB, and
log_softmax, exp and their gradients hold several copies of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from prime_rl.trainer.batch import PackedBatch

CHUNK_LOGITS = 2**25
"""Logits per chunk when the chunk's tokens are not configured: the chunk's tokens follow the
vocabulary, so a small vocabulary runs a micro-batch in one chunk."""

LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
"""Config fields of models whose logits are not just lm_head(hidden): those take the full-logits path."""


class ChunkedTokenLogprobs(torch.autograd.Function):
    """(log p(targets), entropy) per row of `hidden`, with logits = (hidden @ weight.T + bias) / T.

    Forward keeps only the hidden states, the head and one log-sum-exp (and the entropy) per row;
    backward recomputes each chunk's logits and uses d logp(y) / d z = (onehot(y) - p) / T and, when
    the entropy is differentiated (an entropy bonus), d H / d z = -p (log p + H) / T.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk_tokens: int):
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for s in range(0, n, chunk_tokens):
            e = min(s + chunk_tokens, n)
            z = _chunk_logits(hidden[s:e], weight, bias, temperature)
            lse[s:e] = torch.logsumexp(z, dim=-1)
            z.sub_(lse[s:e, None])  # z now holds log-probabilities: no second [chunk x vocab] buffer
            logp[s:e] = z.gather(-1, targets[s:e, None]).squeeze(-1)
            entropy[s:e] = -torch.einsum("cv,cv->c", z.exp(), z)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.set_materialize_grads(False)  # an unused entropy (no bonus) costs the backward nothing
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None
        # Accumulated over chunks in float32 whatever the parameter dtype (bf16 sums lose bits).
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        n = hidden.shape[0]
        for s in range(0, n, ctx.chunk_tokens):
            e = min(s + ctx.chunk_tokens, n)
            g = grad_logp[s:e].float() if grad_logp is not None else lse.new_zeros(e - s)
            z = _chunk_logits(hidden[s:e], weight, bias, ctx.temperature)
            if grad_entropy is None:
                dz = z.sub_(lse[s:e, None]).exp_().mul_(-g[:, None])  # -g * softmax, in place
            else:
                logp_chunk = z.sub_(lse[s:e, None])
                h, gh = entropy[s:e, None], grad_entropy[s:e, None].float()
                dz = logp_chunk.exp() * (-g[:, None] - gh * (logp_chunk + h))
            dz.scatter_add_(-1, targets[s:e, None], g[:, None])
            dz.div_(ctx.temperature)
            dz_h = dz.to(hidden.dtype)
            if need_h:
                grad_h[s:e] = dz_h @ weight
            if need_w and weight.dtype == grad_w.dtype:
                grad_w.addmm_(dz_h.t(), hidden[s:e])
            elif need_w:
                grad_w.add_((dz_h.t() @ hidden[s:e]).float())
            if need_b:
                grad_b.add_(dz.sum(0))
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
        )


def _chunk_logits(hidden, weight, bias, temperature: float) -> torch.Tensor:
    # The matmul runs in the model's dtype, as the model's own lm_head would; the softmax in float32.
    return F.linear(hidden, weight, bias).float().div_(temperature)


def head_logprobs(
    hidden: torch.Tensor,
    head: torch.nn.Module,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets[i]), entropy) of the next-token distribution at each row i of hidden [N, H]."""
    bias = getattr(head, "bias", None)
    chunk = chunk_tokens or max(1, CHUNK_LOGITS // head.weight.shape[0])
    return ChunkedTokenLogprobs.apply(hidden, head.weight, bias, targets, temperature, chunk)


def has_plain_head(model: torch.nn.Module) -> bool:
    """Whether logits are lm_head(final hidden state) and nothing else (so they can be chunked)."""
    config = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return (
        isinstance(head, torch.nn.Linear)
        and getattr(model, "base_model", model) is not model
        and not any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS)
    )


def next_token_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """The token each position predicts: input_ids shifted left by one (the last predicts nothing: 0)."""
    return torch.cat([input_ids[1:], input_ids.new_zeros(1)])


def align_to_tokens(per_position: torch.Tensor) -> torch.Tensor:
    """Values computed at each position for the next token, moved to that token: [0, v_0, ..., v_{T-2}]."""
    return torch.cat([per_position.new_zeros(1), per_position[:-1]])


def forward_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy), each of shape [T], for one packed micro-batch of shape [T]."""
    lp, entropy = position_logprobs(
        model, input_ids, position_ids, next_token_targets(input_ids), temperature, chunk_tokens
    )
    return align_to_tokens(lp), align_to_tokens(entropy.detach())


def position_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    rows: torch.Tensor | None = None,
    **model_kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(targets[i]), entropy) at each position i of a packed sequence of shape [T]: the
    model's own method when `build_model` gave it one (FSDP runs it like forward), else computed here.
    With `rows` ([R] int64 positions), only those positions' (0 elsewhere). `model_kwargs` go to the
    model's body (the context-parallel shard)."""
    method = getattr(model, "prime_rl_position_logprobs", None)
    if method is not None:
        return method(input_ids, position_ids, targets, temperature, chunk_tokens, rows, **model_kwargs)
    return _position_logprobs(
        model, input_ids, position_ids, targets, temperature, chunk_tokens, rows, **model_kwargs
    )


def _position_logprobs(
    model, input_ids, position_ids, targets, temperature, chunk_tokens, rows=None, **model_kwargs
):
    if not has_plain_head(model):
        lp, entropy = full_logits_logprobs(
            model, input_ids, position_ids, targets, temperature, **model_kwargs
        )
        if rows is None:
            return lp, entropy
        keep = torch.zeros_like(lp, dtype=torch.bool).index_fill_(0, rows, True)
        return torch.where(keep, lp, 0.0), torch.where(keep, entropy, 0.0)
    out = model.base_model(
        input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, **model_kwargs
    )
    hidden, head = out.last_hidden_state[0], model.get_output_embeddings()
    if rows is None:
        return head_logprobs(hidden, head, targets, temperature, chunk_tokens)
    # The head only where a loss token is predicted: a prompt's positions cost the body, which the
    # completion attends to, but not the vocabulary (at a real one, most of a small model's step).
    lp, entropy = head_logprobs(hidden[rows], head, targets[rows], temperature, chunk_tokens)
    zeros = lp.new_zeros(hidden.shape[0])
    return zeros.index_copy(0, rows, lp), zeros.index_copy(0, rows, entropy)


def full_logits_logprobs(model, input_ids, position_ids, targets, temperature: float = 1.0, **model_kwargs):
    """The reference path: the model's full [T x vocab] logits (models whose logits are transformed)."""
    logits = model(
        input_ids=input_ids[None], position_ids=position_ids[None], use_cache=False, **model_kwargs
    ).logits[0]
    logp = F.log_softmax(logits.float() / temperature, dim=-1)
    token_logp = logp.gather(-1, targets[:, None].long()).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def attach_position_logprobs(model: torch.nn.Module) -> None:
    """Give `model` the method `prime_rl_position_logprobs`, so FSDP2 can run it with the hooks it runs
    around forward (gathering the root's parameters: embeddings, final norm, lm_head)."""

    def method(input_ids, position_ids, targets, temperature=1.0, chunk_tokens=None, rows=None, **kw):
        return _position_logprobs(
            model, input_ids, position_ids, targets, temperature, chunk_tokens, rows, **kw
        )

    model.prime_rl_position_logprobs = method


def batch_logprobs(
    model: torch.nn.Module, b: PackedBatch, chunk_tokens: int | None, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs, entropy) of a whole packed micro-batch's loss tokens at its sampling temperature,
    aligned to tokens, 0 on the other tokens (no loss, metric or estimator reads them); this rank
    computes its shard's positions, gathered back to full length. The entropy is differentiable only
    with `entropy_grad`."""
    shard = b.shard
    lp, entropy = position_logprobs(
        model,
        shard.take(b.input_ids),
        shard.take(b.position_ids),
        shard.take(next_token_targets(b.input_ids)),
        b.temperature,
        chunk_tokens,
        rows=b.head_rows,
        **shard.model_kwargs(),
    )
    if not entropy_grad:
        entropy = entropy.detach()
    return align_to_tokens(shard.gather(lp)), align_to_tokens(shard.gather(entropy))
