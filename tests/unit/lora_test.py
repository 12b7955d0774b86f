"""LoRA in the trainer: adapters on the configured layers only, the base model at step 0, the same
training on 1 and 2 ranks, checkpoints of the adapter alone, and the adapter's files."""

import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from prime_rl.config import parse_config
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.model import ModelLoadError, build_model
from prime_rl.trainer.parallel.dist import World

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "helpers"))
from grad_worker import make_samples, rank_micro_batches
from trainer_grad_test import run_worker


def logprobs(model, ids: list[int]) -> torch.Tensor:
    t = torch.tensor(ids)
    with torch.no_grad():
        return forward_logprobs(model, t, torch.arange(len(ids)))[0]


def lora_config(model, tmp_path, **lora):
    return TrainerConfig(
        model={"name": str(model)},
        lora={"rank": 4, "alpha": 8.0, **lora},
        seq_len=128,
        output_dir=tmp_path,
        optim={"lr": 1e-2},
    )


def test_only_the_adapter_trains_and_it_starts_as_the_base_model(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    config = lora_config(tiny_model, tmp_path, target_modules=["q_proj", "down_proj"])
    model = build_model(config.model, World(), lora=config.lora, seed=0)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert {n.split(".")[-4] for n in trained} == {"q_proj", "down_proj"}
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = [5, 17, 42, 99, 7, 3]
    torch.testing.assert_close(logprobs(model, ids), logprobs(base, ids))
    # The same adapter on every rank and in every run: A is drawn from the seed.
    again = build_model(config.model, World(), lora=config.lora, seed=0)
    name = trained[0] if ".lora_A." in trained[0] else trained[1]
    torch.testing.assert_close(dict(model.named_parameters())[name], dict(again.named_parameters())[name])


def test_a_target_module_the_model_lacks_is_named(tiny_model, tmp_path):
    config = lora_config(tiny_model, tmp_path, target_modules=["q_proj", "query_key_value"])
    with pytest.raises(ModelLoadError) as e:
        build_model(config.model, World(), lora=config.lora)
    msg = str(e.value)
    assert "trainer.lora.target_modules" in msg and "'query_key_value'" in msg and "q_proj" in msg


@pytest.mark.parametrize("bad", ["--lora.rank=0", "--lora.rank=-2", "--lora.alpha=0"])
def test_a_bad_rank_or_alpha_is_named(tiny_model, bad, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(TrainerConfig, ["--model.name", str(tiny_model), bad], prog="trainer")
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"'{bad.split('=')[0].removeprefix('--')}'" in err and "Traceback" not in err


def test_adapters_are_published_as_files(tiny_model, capsys):
    with pytest.raises(SystemExit):
        parse_config(
            TrainerConfig,
            ["--model.name", str(tiny_model), "--lora.rank=8", "--weight-broadcast.type=collective"],
            prog="trainer",
        )
    err = capsys.readouterr().err
    assert "trainer.lora" in err and "filesystem" in err


def test_two_ranks_train_the_adapters_as_one_does(tiny_model, tmp_path):
    """Two optimizer steps (A only gets gradients once B moved) with GAE, a critic body with its own
    adapter, and KL in the reward against the model with its adapters off."""
    one = run_worker(tiny_model, tmp_path / "one.pt", 1, 0, "lora", "gae", "steps=2")
    two = run_worker(tiny_model, tmp_path / "two.pt", 2, 11, "lora", "gae", "steps=2")
    names = set(one["after"])
    assert names == set(two["after"])
    assert any(".lora_A." in n and not n.startswith("critic.") for n in names)
    assert any(n.startswith("critic.body.") and ".lora_B." in n for n in names)
    assert "critic.head.weight" in names
    assert all(".lora_" in n or n.startswith("critic.head.") for n in names)
    for name in names:
        moved = (one["after"][name] - one["before"][name]).abs().max()
        assert moved > 0, f"{name} did not train"
        torch.testing.assert_close(two["after"][name], one["after"][name], rtol=1e-4, atol=1e-6, msg=name)
    # Rank 0 published the adapter gathered from both ranks' shards: it is the trained one.
    published = load_file(tmp_path / "published" / "weights" / "step_2" / "adapter_model.safetensors")
    policy = {n: t for n, t in two["after"].items() if not n.startswith("critic.")}
    assert len(published) == len(policy)
    for name, t in policy.items():
        torch.testing.assert_close(published["base_model.model." + name.replace(".default.", ".")], t)
    for step in range(2):
        kl = one["metrics"][step]["kl_reward/kl_per_sample"]
        assert kl == pytest.approx(two["metrics"][step]["kl_reward/kl_per_sample"], rel=1e-5)


def test_the_reference_is_the_base_model_with_the_adapters_off(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from prime_rl.trainer.lora import adapters_off
    from prime_rl.trainer.rl.trainer import Trainer

    world = World()
    trainer = Trainer(lora_config(tiny_model, tmp_path), world)
    assert trainer.ref_model is None  # no second copy of the weights
    for seed in range(2):
        trainer.train_step(rank_micro_batches(world, 0, seed), seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids = [5, 17, 42, 99, 7, 3, 250, 11]
    with adapters_off(trainer.model):
        torch.testing.assert_close(logprobs(trainer.model, ids), logprobs(base, ids))
    assert not torch.allclose(logprobs(trainer.model, ids), logprobs(base, ids))
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    assert trained and all(".lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)


def test_a_checkpoint_holds_the_adapter_and_resumes_it(tiny_model, tmp_path):
    from prime_rl.trainer.rl.trainer import Trainer
    from prime_rl.trainer.weights.checkpoint import Checkpointer

    config = lora_config(tiny_model, tmp_path)
    world = World()
    trainer = Trainer(config, world)
    trainer.train_step(rank_micro_batches(world, 0, 0), 0)
    path = Checkpointer(
        tmp_path / "ckpt", world, 2, trainer.model, trainer.optimizer, trainer.scheduler
    ).save(1)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    base = sum(p.numel() * 4 for n, p in trainer.model.named_parameters() if not p.requires_grad)
    assert size < base / 2  # the frozen base weights are not in it
    fresh = Trainer(config, world)
    Checkpointer(tmp_path / "ckpt", world, 2, fresh.model, fresh.optimizer, fresh.scheduler).load(1)
    for (n, a), b in zip(trainer.model.named_parameters(), fresh.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=n)
    # Both go on identically: the optimizer state came back too.
    for t in (trainer, fresh):
        t.train_step(rank_micro_batches(world, 0, 1), 1)
    for (n, a), b in zip(trainer.model.named_parameters(), fresh.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, msg=n)


def test_the_published_adapter_is_peft_format_and_exports_as_the_trained_model(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    from prime_rl.trainer import lora
    from prime_rl.trainer.rl.trainer import Trainer
    from prime_rl.trainer.weights.publish import Publisher

    config = lora_config(tiny_model, tmp_path)
    world = World()
    trainer = Trainer(config, world)
    for seed in range(2):
        trainer.train_step(rank_micro_batches(world, 0, seed), seed)
    publisher = Publisher(tmp_path, str(tiny_model), world, keep=2, lora=config.lora)
    publisher.publish(trainer.model, 2)
    publisher.close()
    folder = tmp_path / "weights" / "step_2"
    assert sorted(f.name for f in folder.iterdir()) == [
        "MANIFEST.json",
        "READY",
        lora.ADAPTER_CONFIG,
        lora.ADAPTER_WEIGHTS,
    ]
    adapter_config = json.loads((folder / lora.ADAPTER_CONFIG).read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["r"] == 4
    assert adapter_config["base_model_name_or_path"] == str(tiny_model)
    tensors = load_file(folder / lora.ADAPTER_WEIGHTS)
    assert all(k.startswith("base_model.model.model.layers.") for k in tensors)
    assert len(tensors) == 2 * 7 * trainer.model.config.num_hidden_layers

    # `uv run export-lora` folds it into a full model that transformers loads without peft.
    from prime_rl.trainer.weights.export_lora import main as export_lora

    export_lora(["--adapter", str(folder), "--output", str(tmp_path / "merged")])
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    sample = make_samples(1, seed=3)[0]
    ids = sample.prompt_ids + sample.completion_ids
    torch.testing.assert_close(logprobs(merged, ids), logprobs(trainer.model, ids))
    untrained = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    assert not torch.allclose(logprobs(untrained, ids), logprobs(merged, ids))
    with pytest.raises(SystemExit):  # never over an existing model
        export_lora(["--adapter", str(folder), "--output", str(tmp_path / "merged")])


def test_a_full_fine_tuning_checkpoint_does_not_load_into_adapters(tiny_model, tmp_path):
    from prime_rl.trainer.rl.trainer import Trainer
    from prime_rl.trainer.weights.checkpoint import Checkpointer, CheckpointError

    world = World()
    full = Trainer(TrainerConfig(model={"name": str(tiny_model)}, seq_len=128, output_dir=tmp_path), world)
    Checkpointer(tmp_path / "ckpt", world, 2, full.model, full.optimizer, full.scheduler).save(1)
    adapters = Trainer(lora_config(tiny_model, tmp_path), world)
    with pytest.raises(CheckpointError, match="does not load into this trainer: RuntimeError: Missing key"):
        Checkpointer(
            tmp_path / "ckpt", world, 2, adapters.model, adapters.optimizer, adapters.scheduler
        ).load(1)


@pytest.mark.parametrize(
    "args, key",
    [
        (
            ["--trainer.lora.rank=32", "--inference.lora.max-rank=16"],
            "'trainer.lora.rank' = 32 is above 'inference.lora.max_rank' = 16",
        ),
        (["--inference.lora.max-rank=12"], "max_rank"),
        (
            ["--orchestrator.lora-adapter=x"],
            "'orchestrator.lora_adapter' = 'x', but the trainer trains full weights",
        ),
        (["--deployment.inference-urls", '["10.0.0.5:8000"]'], "inference_urls"),
    ],
)
def test_lora_settings_that_cannot_work_are_named(tiny_model, args, key, capsys):
    from prime_rl.launcher.config import RLConfig

    with pytest.raises(SystemExit) as e:
        parse_config(RLConfig, ["--model", str(tiny_model), *args], prog="rl")
    err = capsys.readouterr().err
    assert e.value.code == 2 and key in err and "Traceback" not in err, err
