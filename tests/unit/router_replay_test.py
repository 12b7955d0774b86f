"""Router replay: routes equal to the model's own change nothing; others change the output and keep
the router's gradient."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from prime_rl.model.tiny import TinyModelConfig, make_tiny_model
from prime_rl.trainer.moe.replay import replay, router_shape


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    folder = make_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("m") / "moe", preset="tiny-moe",
                                             corpus_lines=500))  # fmt: skip
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def own_routes(model, ids) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=ids[None], output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([logits.topk(k, dim=-1).indices for logits in out.router_logits], dim=1)


def loss_and_grads(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids[None]).logits
    logits.logsumexp(-1).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_replaying_the_models_own_routes_is_no_replay(moe):
    ids = torch.randint(0, 500, (24,))
    routes = own_routes(moe, ids).flip(-1)  # another order of the same experts
    assert routes.shape == (24, *router_shape(moe)[::2])
    ref_logits, ref_grads = loss_and_grads(moe, ids)
    with replay(moe, routes):
        logits, grads = loss_and_grads(moe, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_other_routes_change_the_output_and_the_router_still_learns(moe):
    ids = torch.randint(0, 500, (24,))
    routes = (own_routes(moe, ids) + 3) % moe.config.num_experts  # every token elsewhere
    ref_logits, _ = loss_and_grads(moe, ids)
    with replay(moe, routes):
        logits, grads = loss_and_grads(moe, ids)
    assert (logits - ref_logits).abs().max() > 1e-4
    assert grads["model.layers.0.mlp.gate.weight"].abs().max() > 0
    # Outside the context the model routes by itself again.
    again, _ = loss_and_grads(moe, ids)
    torch.testing.assert_close(again, ref_logits, rtol=0, atol=0)


def test_routes_for_another_number_of_tokens_are_an_error(moe):
    ids = torch.randint(0, 500, (8,))
    with replay(moe, own_routes(moe, ids)[:5]), pytest.raises(ValueError, match="routes for 5 tokens"):
        moe(input_ids=ids[None])


def routed_samples(model, samples, shift: int = 0):
    """`samples` carrying routes: the model's own top-k per token, each expert id moved by `shift`."""
    import msgspec
    import numpy as np

    out = []
    for s in samples:
        ids = torch.tensor(s.prompt_ids + s.completion_ids)
        routes = (own_routes(model, ids) + shift) % model.config.num_experts
        out.append(
            msgspec.structs.replace(
                s, routes=routes.numpy().astype(np.uint8).tobytes(), route_shape=list(routes.shape[1:])
            )
        )
    return out


def step(model_path, tmp_path, samples, **moe):
    from prime_rl.trainer.config import TrainerConfig
    from prime_rl.trainer.parallel.dist import World
    from prime_rl.trainer.rl.trainer import Trainer
    from prime_rl.transport.packing import pack

    config = TrainerConfig(model={"name": str(model_path)}, seq_len=128, output_dir=tmp_path, moe=moe)
    trainer = Trainer(config, World())
    metrics, _ = trainer.train_step(pack(samples, 128, 1, "replay", 0)[0])
    return trainer, metrics


def test_the_trainer_replays_the_routes_its_micro_batches_carry(tiny_moe_model, tmp_path):
    """Routes travel in the micro-batch: the model's own routes change nothing and agree fully;
    other routes change the loss (replay on) or only the agreement (replay off)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from trainer_test import samples

    base = samples(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model, dtype=torch.float32)
    _, plain = step(tiny_moe_model, tmp_path / "plain", base)
    assert "moe/route_agreement" not in plain  # no routes, nothing compared
    _, own = step(tiny_moe_model, tmp_path / "own", routed_samples(model, base))
    assert own["moe/route_agreement"] == 1.0 and own["moe/route_agreement/layer_1"] == 1.0
    assert abs(own["loss"] - plain["loss"]) < 1e-6 and abs(own["grad_norm"] - plain["grad_norm"]) < 1e-5
    moved = routed_samples(model, base, shift=3)
    _, replayed = step(tiny_moe_model, tmp_path / "moved", moved)
    assert replayed["moe/route_agreement"] == 0.0
    assert abs(replayed["loss"] - plain["loss"]) > 1e-4  # other experts ran
    _, compared = step(tiny_moe_model, tmp_path / "compared", moved, replay=False)
    assert compared["moe/route_agreement"] == 0.0
    assert abs(compared["loss"] - plain["loss"]) < 1e-6  # its own routers chose
