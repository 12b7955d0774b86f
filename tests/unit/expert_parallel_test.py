"""Expert parallelism: a MoE model's experts split over ep ranks (gloo all-to-all, FSDP2 over the
copies) trains exactly like one rank holding every expert, alone and with data and context
parallelism; checkpoints resume under another ep; bad layouts are one line."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from prime_rl.trainer.config import TrainedModelConfig, TrainerConfig
from prime_rl.trainer.model import ModelLoadError, build_model
from prime_rl.trainer.moe.expert_parallel import ep_problem
from prime_rl.trainer.parallel.dist import World, WorldError, init_world

sys.path.insert(0, str(Path(__file__).parent))
from context_parallel_test import assert_same_training
from trainer_grad_test import ranks_cmd, run_worker


@pytest.fixture(scope="module")
def one_rank_moe(tiny_moe_model, tmp_path_factory):
    return run_worker(tiny_moe_model, tmp_path_factory.mktemp("ep") / "one.pt", 1, 0, "steps=3")


def experts_moved(run: dict) -> float:
    return max(
        (run["after"][n] - run["before"][n]).abs().max().item() for n in run["after"] if "experts" in n
    )


def test_ep2_trains_like_one_rank(tiny_moe_model, tmp_path, one_rank_moe):
    two = run_worker(tiny_moe_model, tmp_path / "ep2.pt", 2, 6, "steps=3", "ep=2")
    assert experts_moved(one_rank_moe) > 1e-4
    assert_same_training(one_rank_moe, two)
    assert [m["moe/load_max_over_mean"] for m in two["metrics"]] == pytest.approx(
        [m["moe/load_max_over_mean"] for m in one_rank_moe["metrics"]], rel=1e-6
    )


def test_two_expert_groups_of_two_train_like_one_rank(tiny_moe_model, tmp_path, one_rank_moe):
    """4 ranks, ep = 2: each expert shard has two copies (FSDP shards them over the "edp" pair), and
    data parallelism is 4."""
    four = run_worker(tiny_moe_model, tmp_path / "dp4ep2.pt", 4, 5, "steps=3", "ep=2")
    assert_same_training(one_rank_moe, four)


def test_cp2_with_ep2_trains_like_one_rank(tiny_moe_model, tmp_path, one_rank_moe):
    """The two context-parallel halves of each micro-batch send their tokens to each other's experts."""
    two = run_worker(tiny_moe_model, tmp_path / "cp2ep2.pt", 2, 0, "steps=3", "cp=2", "ep=2")
    assert_same_training(one_rank_moe, two)


def test_ep_that_does_not_divide_the_ranks_is_one_line(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(WorldError, match=r"trainer.parallel.ep = 4 does not divide the 2 trainer ranks"):
        init_world(1, 4)


def test_ep_on_a_dense_model_or_one_it_does_not_divide_is_a_config_error(tiny_model, tiny_moe_model):
    with pytest.raises(ValidationError, match=r"parallel.ep = 2 splits a mixture of experts, but model.name = .* is a dense model"):  # fmt: skip
        TrainerConfig(model={"name": str(tiny_model)}, parallel={"ep": 2})
    with pytest.raises(ValidationError, match=r"parallel.ep = 3 does not divide the 8 experts per layer"):
        TrainerConfig(model={"name": str(tiny_moe_model)}, parallel={"ep": 3})


def test_experts_it_cannot_split_name_the_model_class(tiny_moe_model):
    """A MoE whose experts are not the fused 3-D tensors (a list of MLPs, as older models keep
    them) is refused at load, naming the model's class and the experts' class."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_model)
    for layer in model.model.layers:
        layer.mlp.experts = type("ListOfExperts", (torch.nn.Module,), {})()
        layer.mlp.experts.mlps = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
    assert ep_problem(model, 2) == (
        "the experts of Qwen3MoeForCausalLM (ListOfExperts) are not stored as the fused 3-D tensors "
        "gate_up_proj and down_proj that expert parallelism splits"
    )


def test_a_dense_model_given_by_hub_id_is_refused_at_load(tiny_model):
    """Config validation knows only local folders; the model itself is checked when it loads,
    before anything distributed happens."""
    with pytest.raises(
        ModelLoadError,
        match=r"trainer.parallel.ep = 2, but trainer.model.name = .* cannot be split into experts across "
        r"ranks: Qwen3ForCausalLM is a dense model \(it has no experts to split\)\. Use ep = 1",
    ):
        build_model(TrainedModelConfig(name=str(tiny_model)), World(rank=0, world_size=2, ep=2))


def test_ep2_checkpoints_resume_under_ep1(tiny_moe_model, tmp_path):
    """Trained 2 steps with ep = 2 on 2 ranks (the trainer's main, the filesystem transport),
    checkpointed, then resumed with ep = 1 for a third step: the published weights equal
    those of 3 steps at ep = 1 straight. The checkpoint holds each expert tensor whole (DCP reshards
    on load), and the weights published under ep = 2 have every expert too."""
    from safetensors.torch import load_file
    from trainer_test import contract, samples

    from prime_rl.transport.file_transport import FileSender
    from prime_rl.transport.packing import pack

    def run(name: str, ep: int, max_steps: int, feed: range) -> Path:
        data, out = tmp_path / f"{name}-data", tmp_path / name
        sender = FileSender(data)
        for step in feed:
            for rank in pack(samples(step, n=12), 128, 2, name, step, orchestrator=contract(ranks=2)):
                for mb in rank:
                    sender.send(mb)
        toml = tmp_path / f"{name}.toml"
        toml.write_text(
            f'output_dir = "{out}"\nmax_steps = {max_steps}\nseq_len = 128\n[model]\nname = "{tiny_moe_model}"\n'
            f"[parallel]\nep = {ep}\n[optim]\nlr = 1e-3\neps = 1e-3\n[ckpt]\ninterval = 2\nresume_step = -1\n"
            f'[transport]\ntype = "filesystem"\ndir = "{data}"\nrun_id = "{name}"\ntimeout_s = 60\n'
        )
        cmd = ranks_cmd(2, "-m", "prime_rl.trainer.main", "@", str(toml))
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return out

    first = run("ep", 2, 2, range(2))
    resumed = run("ep", 1, 3, range(2, 3))
    straight = run("one", 1, 3, range(3))
    under_ep2 = load_file(first / "weights" / "step_2" / "model.safetensors")
    a, b = (load_file(o / "weights" / "step_3" / "model.safetensors") for o in (resumed, straight))
    assert {k: v.shape for k, v in under_ep2.items()} == {k: v.shape for k, v in b.items()}
    assert max((b[k] - under_ep2[k]).abs().max().item() for k in b if "experts" in k) > 1e-4  # step 3 trained
    for name, w in b.items():
        torch.testing.assert_close(a[name], w, rtol=1e-5, atol=1e-6, msg=f"{name} differs")
    straight_2 = load_file(straight / "weights" / "step_2" / "model.safetensors")
    for name, w in straight_2.items():  # what ep = 2 published is what ep = 1 would have
        torch.testing.assert_close(under_ep2[name], w, rtol=1e-5, atol=1e-6, msg=f"{name} published differs")
