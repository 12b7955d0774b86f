"""Packed attention without a [T, T] mask equals transformers' dense-mask path."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from prime_rl.trainer.attention import (
    configure_attention,
    plan_for_samples,
    sample_starts,
    use_packed_attention,
)


def tiny_model():
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=50)  # fmt: skip
    return AutoModelForCausalLM.from_config(config).float()


def logits_and_grads(model, ids, pos):
    model.zero_grad()
    logits = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits
    logits.logsumexp(-1).mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


def test_sample_starts_reads_samples_from_positions():
    pos = torch.tensor([0, 1, 2, 0, 0, 1, 0, 1, 2, 3])
    assert sample_starts(pos).tolist() == [0, 3, 4, 6, 10]
    assert sample_starts(torch.tensor([0, 0, 0])).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("lengths", [[7, 1, 12, 1, 1, 9], [5, 5, 5, 3, 3, 1], [30]])
def test_packed_attention_equals_dense_mask(lengths):
    """Runs of equal lengths (batched together) and samples of length 1 included."""
    model = tiny_model()
    pos = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.randint(0, 50, pos.shape)
    model.set_attn_implementation("sdpa")
    ref_logits, ref_grads = logits_and_grads(model, ids, pos)
    use_packed_attention(model, "packed")
    logits, grads = logits_and_grads(model, ids, pos)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-5)


def test_packed_attention_keeps_samples_apart():
    """Changing one sample's tokens leaves every other sample's logits as they were."""
    model = tiny_model()
    use_packed_attention(model, "packed")
    pos = torch.cat([torch.arange(6), torch.arange(4)])
    ids = torch.randint(0, 50, pos.shape)
    changed = ids.clone()
    changed[:6] = (changed[:6] + 1) % 50
    with torch.no_grad():
        a = model(input_ids=ids[None], position_ids=pos[None]).logits[0]
        b = model(input_ids=changed[None], position_ids=pos[None]).logits[0]
    torch.testing.assert_close(a[6:], b[6:], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:6], b[:6])


def test_packed_equals_each_sample_alone():
    """Logprobs and gradients of a packed micro-batch equal those of its samples run one by one."""
    model = tiny_model()
    use_packed_attention(model, "packed")
    lengths = [9, 1, 14, 3]
    ids = [torch.randint(0, 50, (n,)) for n in lengths]
    packed_logits, packed_grads = logits_and_grads(
        model, torch.cat(ids), torch.cat([torch.arange(n) for n in lengths])
    )
    model.set_attn_implementation("sdpa")
    model.zero_grad()
    alone = []
    for x in ids:
        logits = model(input_ids=x[None], position_ids=torch.arange(len(x))[None], use_cache=False).logits
        logits.logsumexp(-1).sum().div(sum(lengths)).backward()
        alone.append(logits.detach())
    torch.testing.assert_close(packed_logits, torch.cat(alone, 1), rtol=0, atol=1e-5)
    for p, g in zip(model.parameters(), packed_grads, strict=True):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=1e-5)


def test_samples_of_similar_length_share_a_call():
    """Short samples cost a few batched calls, not one each; a lone long sample is attended in place."""
    plan = plan_for_samples([40, 38, 35, 50, 33, 1, 1, 2, 500], torch.device("cpu"))
    assert len(plan.buckets) <= 4
    start = sum([40, 38, 35, 50, 33, 1, 1, 2])
    assert plan.buckets[-1].rows == (start, 1, 500)
    equal = plan_for_samples([64, 64, 64], torch.device("cpu"))  # attended as views of the rows
    assert equal.buckets[0].rows == (0, 3, 64) and equal.out_rows is None


def test_each_mechanism_says_where_it_runs():
    model = tiny_model()
    cpu = torch.device("cpu")
    assert configure_attention(model, "auto", cpu, cp=1) == "packed"
    assert model.config._attn_implementation == "prime_rl_packed"
    with pytest.raises(ValueError, match="'flex' runs on CUDA only"):
        configure_attention(model, "flex", cpu, cp=1)
    with pytest.raises(ValueError, match="only 'packed' attends"):
        configure_attention(model, "dense", cpu, cp=2)


def test_a_sliding_window_model_keeps_dense_attention_unless_packed_is_asked_for():
    model = tiny_model()
    model.config.use_sliding_window = True
    assert configure_attention(model, "auto", torch.device("cpu"), cp=1) == "dense"
    with pytest.raises(ValueError, match=r"sliding-window attention.*use 'dense'"):
        configure_attention(model, "packed", torch.device("cpu"), cp=1)


def test_the_trainer_step_is_the_same_with_packed_and_dense_attention(tiny_model, tmp_path):
    """Multi-turn samples (loss masks with gaps) and samples of length 1 and 2, packed: the trainer's
    per-token statistics (logprobs, entropy, mismatch KL, loss) and gradients with packed attention
    equal the dense mask's."""
    import random

    from prime_rl.trainer.config import TrainerConfig
    from prime_rl.trainer.parallel.dist import init_world
    from prime_rl.trainer.rl.trainer import Trainer
    from prime_rl.transport.messages import TrainingSample
    from prime_rl.transport.packing import pack

    rng = random.Random(0)
    samples = []
    for p, c in [(5, 30), (1, 1), (12, 20), (1, 1), (3, 40), (7, 9)]:
        mask = [1 if (i // 6) % 2 == 0 else 0 for i in range(c)]  # turns: sampled, env, sampled...
        samples.append(TrainingSample([rng.randrange(3, 500) for _ in range(p)], [rng.randrange(3, 500) for _ in range(c)],
                                      mask, [-5.0] * c, rng.uniform(-1, 1), 0.0, "env"))  # fmt: skip
    mbs = pack(samples, 256, 1, "p", 0)[0]
    results = {}
    for attention in ("packed", "dense"):
        config = TrainerConfig(model={"name": str(tiny_model), "attention": attention}, seq_len=256,
                               output_dir=str(tmp_path / attention))  # fmt: skip
        trainer = Trainer(config, init_world())
        assert (
            trainer.model.config._attn_implementation
            == {"packed": "prime_rl_packed", "dense": "sdpa"}[attention]
        )
        stats = trainer.accumulate(mbs, 0).metrics
        grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters()}
        results[attention] = (stats, grads)
    (packed, packed_grads), (dense, dense_grads) = results["packed"], results["dense"]
    assert packed.keys() == dense.keys()
    for key, value in dense.items():
        assert abs(packed[key] - value) <= 1e-5 * max(1.0, abs(value)), key
    for name, g in dense_grads.items():
        assert g.abs().max() > 0 or "embed" in name, name
        torch.testing.assert_close(packed_grads[name], g, rtol=1e-5, atol=1e-6)
