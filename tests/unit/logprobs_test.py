"""Chunked logprobs and entropy: the same values and gradients as the full-logits path, with memory
that does not grow with tokens x vocabulary."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from prime_rl.trainer.logprobs import (
    align_to_tokens,
    forward_logprobs,
    full_logits_logprobs,
    has_plain_head,
    next_token_targets,
)


def model(vocab: int = 1000, bias: bool = False, tie: bool = False) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=tie)  # fmt: skip
    m = Qwen3ForCausalLM(config)
    if bias:
        m.lm_head.bias = torch.nn.Parameter(torch.randn(vocab) * 0.1)
    return m


def reference(m, ids, pos, temperature):
    lp, entropy = full_logits_logprobs(m, ids, pos, next_token_targets(ids), temperature)
    return align_to_tokens(lp), align_to_tokens(entropy)


def grads_of(m, fn, weights) -> tuple[torch.Tensor, torch.Tensor, dict]:
    m.zero_grad()
    lp, entropy = fn()
    (lp * weights).sum().backward()
    return lp.detach(), entropy, {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize(("chunk", "temperature", "bias", "tie"), [(64, 1.0, False, False), (7, 0.7, True, False),
                                                                  (1000, 1.3, False, True)])  # fmt: skip
def test_chunked_equals_full_logits_values_and_gradients(chunk, temperature, bias, tie):
    m = model(bias=bias, tie=tie)
    ids = torch.randint(0, 1000, (300,))
    pos = torch.cat([torch.arange(120), torch.arange(180)])  # two packed samples
    w = torch.randn(300)
    lp, ent, g = grads_of(m, lambda: forward_logprobs(m, ids, pos, temperature, chunk_tokens=chunk), w)
    lp_ref, ent_ref, g_ref = grads_of(m, lambda: reference(m, ids, pos, temperature), w)
    torch.testing.assert_close(lp, lp_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    assert not ent.requires_grad
    for name, ref in g_ref.items():
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(g[name], ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=name)


def test_models_whose_logits_are_transformed_take_the_full_path():
    m = model()
    assert has_plain_head(m)
    m.config.final_logit_softcapping = 30.0
    assert not has_plain_head(m)


def test_memory_does_not_grow_with_tokens_times_vocabulary(tmp_path):
    """Forward and backward of 4,096 tokens at a 50,000 vocabulary: the full float logits alone are
    0.8 GB, and log_softmax with its gradient holds several copies; chunks of 64 tokens hold 13 MB."""
    script = tmp_path / "peak.py"
    script.write_text(
        textwrap.dedent("""
        import sys, torch
        from transformers import Qwen3Config, Qwen3ForCausalLM
        from prime_rl.trainer.logprobs import forward_logprobs

        def status(key):
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key)) / 2**20

        config = Qwen3Config(vocab_size=50_000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
        m = Qwen3ForCausalLM(config)
        ids = torch.randint(0, 50_000, (4096,))
        before = status("VmRSS")
        open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) from here
        lp, _ = forward_logprobs(m, ids, torch.arange(4096), chunk_tokens=64)
        lp.sum().backward()
        print(status("VmHWM") - before)
    """)
    )
    # One thread: the peak is the same whatever the threads, and with another process busy on the
    # other core two threads spend their time waiting on each other (tests/conftest.py).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    growth_gb = float(proc.stdout.split()[-1])
    assert growth_gb < 0.3, f"peak grew {growth_gb:.2f} GB"


@pytest.mark.parametrize(("chunk", "temperature"), [(64, 1.0), (7, 0.7)])
def test_the_entropy_is_differentiated_like_the_full_logits(chunk, temperature):
    """An entropy bonus differentiates the entropy: the chunked backward's d H / d z equals autograd
    through the full logits, together with the logprobs' gradient."""
    from prime_rl.trainer.logprobs import position_logprobs

    m = model(bias=True)
    ids = torch.randint(0, 1000, (200,))
    pos = torch.cat([torch.arange(90), torch.arange(110)])
    w, v = torch.randn(200), torch.randn(200)

    def run(fn):
        m.zero_grad()
        lp, entropy = fn()
        (lp * w + entropy * v).sum().backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    targets = next_token_targets(ids)
    chunked = run(lambda: position_logprobs(m, ids, pos, targets, temperature, chunk))
    full = run(lambda: full_logits_logprobs(m, ids, pos, targets, temperature))
    only_lp = run(lambda: (position_logprobs(m, ids, pos, targets, temperature, chunk)[0], torch.zeros(200)))
    for name, ref in full.items():
        torch.testing.assert_close(
            chunked[name], ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=name
        )
    assert (chunked["lm_head.weight"] - only_lp["lm_head.weight"]).abs().max() > 1e-4  # the entropy's share


@pytest.mark.parametrize(("chunk", "bias"), [(64, False), (7, True)])
def test_only_the_rows_asked_for_go_through_the_head(chunk, bias, monkeypatch):
    """A micro-batch's loss tokens are where the head is needed: with `rows`, logprobs, entropies and
    every gradient equal the full path's on those rows, the rest are 0, and the head (the vocabulary's
    matmul) sees no other row."""
    from prime_rl.trainer import logprobs
    from prime_rl.trainer.logprobs import position_logprobs

    m = model(bias=bias)
    ids = torch.randint(0, 1000, (300,))
    pos = torch.cat([torch.arange(120), torch.arange(180)])
    targets = next_token_targets(ids)
    rows = torch.zeros(300, dtype=torch.bool)
    rows[80:119] = rows[200:299] = True  # each sample's completion, as the loss mask shifted by one
    w, v = torch.randn(300) * rows, torch.randn(300) * rows

    seen = []
    chunk_logits = logprobs._chunk_logits
    monkeypatch.setattr(
        logprobs, "_chunk_logits", lambda h, *a: seen.append(h.shape[0]) or chunk_logits(h, *a)
    )

    def run(rows_arg):
        m.zero_grad()
        index = None if rows_arg is None else rows_arg.nonzero().squeeze(-1)
        lp, entropy = position_logprobs(m, ids, pos, targets, 0.8, chunk, rows=index)
        (lp * w + entropy * v).sum().backward()
        return lp.detach(), entropy.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    lp, ent, grads = run(rows)
    assert sum(seen) == 2 * int(rows.sum())  # forward, and the backward's recomputation
    seen.clear()
    lp_all, ent_all, grads_all = run(None)
    assert sum(seen) == 2 * 300
    torch.testing.assert_close(lp[rows], lp_all[rows], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[rows], ent_all[rows], rtol=1e-5, atol=1e-5)
    assert (lp[~rows] == 0).all() and (ent[~rows] == 0).all()
    for name, ref in grads_all.items():
        assert ref.abs().max() > 0, name
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item(), msg=name)


def test_a_model_with_transformed_logits_gives_the_same_rows_through_the_full_path():
    from prime_rl.trainer.logprobs import position_logprobs

    m = model()
    m.config.final_logit_softcapping = 30.0  # read by `has_plain_head` (Qwen3's forward ignores it)
    assert not has_plain_head(m)
    ids = torch.randint(0, 1000, (100,))
    pos, targets = torch.arange(100), next_token_targets(ids)
    rows = torch.tensor([3, 4, 50, 98])
    with torch.no_grad():
        lp, entropy = position_logprobs(m, ids, pos, targets, 1.0, None, rows=rows)
        lp_all, entropy_all = position_logprobs(m, ids, pos, targets, 1.0, None)
    keep = torch.zeros(100, dtype=torch.bool)
    keep[rows] = True
    torch.testing.assert_close(lp[keep], lp_all[keep])
    torch.testing.assert_close(entropy[keep], entropy_all[keep])
    assert (lp[~keep] == 0).all() and (entropy[~keep] == 0).all() and (lp_all[~keep] != 0).all()
