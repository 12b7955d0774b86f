"""Expert load in the trainer's step metrics: per layer, the busiest expert over the mean, counted
over every token the step forwards."""

import sys
from pathlib import Path

import torch

from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.rl.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from trainer_test import micro_batches


def routed_counts(model, mbs) -> torch.Tensor:
    """Independently: the model's own top-k per token of each micro-batch, counted per layer."""
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
    counts = torch.zeros(model.config.num_hidden_layers, experts)
    with torch.no_grad():
        for mb in mbs:
            a = mb.arrays()
            ids = torch.from_numpy(a["input_ids"].astype("int64"))[None]
            pos = torch.from_numpy(a["position_ids"].astype("int64"))[None]
            # use_cache=False, as the trainer: with a cache transformers ignores the packing.
            out = model(input_ids=ids, position_ids=pos, output_router_logits=True, use_cache=False)
            for layer, logits in enumerate(out.router_logits):
                counts[layer] += torch.bincount(logits.topk(k, dim=-1).indices.flatten(), minlength=experts)
    return counts


def test_the_step_reports_each_layers_expert_load(tiny_moe_model, tmp_path):
    trainer = Trainer(
        TrainerConfig(model={"name": str(tiny_moe_model)}, seq_len=128, output_dir=tmp_path), World()
    )
    mbs = micro_batches(0, "moe")
    expected = routed_counts(trainer.model, mbs)  # before the step changes the weights
    metrics, _ = trainer.train_step(mbs)
    for layer, row in enumerate(expected):
        want = float(row.max() / row.mean())
        assert abs(metrics[f"moe/load_max_over_mean/layer_{layer}"] - want) < 1e-6
    assert 1.0 < metrics["moe/load_max_over_mean"] <= trainer.model.config.num_experts


def test_a_dense_model_reports_no_expert_load(tiny_model, tmp_path):
    trainer = Trainer(
        TrainerConfig(model={"name": str(tiny_model)}, seq_len=128, output_dir=tmp_path), World()
    )
    metrics, _ = trainer.train_step(micro_batches(0, "dense"))
    assert not any(k.startswith("moe/") for k in metrics)


def balance_loss(logits: torch.Tensor, k: int) -> float:
    """Switch Transformer's loss from its formula: experts x sum_e (share of slots on e) x (mean prob of e)."""
    probs = torch.softmax(logits.double(), dim=-1)
    experts = probs.shape[-1]
    slots = torch.bincount(probs.topk(k, dim=-1).indices.flatten(), minlength=experts).double()
    return float(experts * ((slots / slots.sum()) * probs.mean(0)).sum())


def test_the_load_balancing_loss_is_the_switch_formula_and_trains_the_routers(tiny_moe_model, tmp_path):
    config = {"model": {"name": str(tiny_moe_model)}, "seq_len": 128}
    trainer = Trainer(TrainerConfig(**config, output_dir=tmp_path / "off"), World())
    mbs = micro_batches(0, "moe")
    tokens = [int(mb.arrays()["loss_mask"].sum()) for mb in mbs]
    expected = 0.0
    with torch.no_grad():
        for mb, n in zip(mbs, tokens, strict=True):
            a = mb.arrays()
            ids = torch.from_numpy(a["input_ids"].astype("int64"))[None]
            pos = torch.from_numpy(a["position_ids"].astype("int64"))[None]
            out = trainer.model(input_ids=ids, position_ids=pos, output_router_logits=True, use_cache=False)
            per_layer = [
                balance_loss(lg, trainer.model.config.num_experts_per_tok) for lg in out.router_logits
            ]
            expected += sum(per_layer) / len(per_layer) * n / sum(tokens)
    off, _ = trainer.train_step(mbs)
    assert abs(off["moe/aux_loss"] - expected) < 1e-5 and expected > 1.0
    on = Trainer(TrainerConfig(**config, output_dir=tmp_path / "on", moe={"aux_loss_coef": 1.0}), World())
    on.train_step(mbs)
    gate = "model.layers.0.mlp.gate.weight"
    params_off, params_on = dict(trainer.model.named_parameters()), dict(on.model.named_parameters())
    assert (params_off[gate] - params_on[gate]).abs().max() > 1e-6  # the loss reached the router
