"""The fake-GPU dry run of the trainer (`trainer --fake-gpu`) and the memory planner built on it.

Every dry run is a process of its own: registering the fake GPU with torch cannot be undone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = Path(__file__).parents[1] / "helpers" / "dry_run_faults.py"


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


def trainer_toml(path: Path, model: Path, extra: str = "") -> Path:
    path.write_text(
        f'seq_len = 256\noutput_dir = "{path.parent / "out"}"\n[model]\nname = "{model}"\n{extra}'
    )
    return path


def test_dry_run_dp2_cp2_with_lora_critic_and_checkpointing(tiny_model, tmp_path):
    cfg = trainer_toml(
        tmp_path / "t.toml",
        tiny_model,
        'activation_checkpointing = true\n[parallel]\ncp = 2\n[lora]\nrank = 8\n[advantage]\ntype = "gae"\n',
    )
    out = run("-m", "prime_rl.trainer.main", "@", str(cfg), "--fake-gpu", "--ranks", "4")
    assert out.returncode == 0, out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert "fake-GPU dry run passed" in line
    assert "dp 2 x cp 2, LoRA, activation checkpointing, critic" in line
    for loss in ("losses: ppo, cpgd", "gspo", "kl penalty"):
        assert loss in line


def test_a_cpu_tensor_in_a_collective_fails_with_one_line(tiny_model):
    out = run(str(HELPER), "collective", str(tiny_model))
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("caught: torch.distributed.all_reduce got a tensor on cpu")
    assert "dry_run_faults.py:" in line and "through all_reduce_sum" in line  # the code line, then the helper


def test_a_cpu_tensor_in_a_device_op_of_a_loss_plugin_fails_with_one_line(tiny_model, tmp_path):
    cfg = trainer_toml(tmp_path / "t.toml", tiny_model, '[loss]\ntype = "dry_run_faults:cpu_loss"\n')
    out = run("-m", "prime_rl.trainer.main", "@", str(cfg), "--fake-gpu", "--ranks", "2", cwd=HELPER.parent)
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("trainer:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr
    assert "fake-GPU dry run failed: aten.mul.Tensor mixes tensors on cpu and fakegpu:0" in errors[0]
    assert "dry_run_faults.py:" in errors[0] and "weight" in errors[0]  # the plugin's own line


def test_ranks_must_be_a_multiple_of_cp(tiny_model, tmp_path):
    cfg = trainer_toml(tmp_path / "t.toml", tiny_model, "[parallel]\ncp = 2\n")
    out = run("-m", "prime_rl.trainer.main", "@", str(cfg), "--fake-gpu", "--ranks", "3")
    assert out.returncode == 2 and "--ranks 3 is not a multiple of trainer.parallel.cp = 2" in out.stderr


def test_expert_parallelism_is_refused_in_one_line(tiny_moe_model, tmp_path):
    cfg = trainer_toml(tmp_path / "t.toml", tiny_moe_model, "[parallel]\nep = 2\n")
    out = run("-m", "prime_rl.trainer.main", "@", str(cfg), "--fake-gpu", "--ranks", "2")
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "trainer: error: the fake-GPU dry run does not model trainer.parallel.ep = 2 (the all-to-all's sizes "
        "depend on the routing of real data, which fake tensors do not have); dry-run the config with ep = 1"
    ]


def plan(model: Path, *flags: str) -> dict:
    out = run(
        "-m", "prime_rl.trainer.gpu.plan_memory", "--model", str(model), "--json", "--no-search", *flags
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_bytes"]


@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_plan_memory_splits_the_peak_and_follows_the_setup(tiny_model, device):
    base = plan(tiny_model, "--seq-len", "512", "--dtype", "float32", "--device", device)
    assert base["total"] == sum(base[k] for k in ("parameters", "gradients", "optimizer", "activations"))
    params = sum(
        t.numel() * 4
        for t in __import__("safetensors.torch").torch.load_file(tiny_model / "model.safetensors").values()
    )
    assert abs(base["parameters"] - params) <= 0.05 * params  # the model's weights, float32
    assert base["optimizer"] >= 2 * params * 0.95  # AdamW's two moments
    longer = plan(tiny_model, "--seq-len", "2048", "--dtype", "float32", "--device", device)
    assert longer["activations"] > 2 * base["activations"]
    if device == "gpu":  # FSDP over 4 ranks keeps a quarter of the parameters and state per GPU
        sharded = plan(tiny_model, "--seq-len", "512", "--dtype", "float32", "--dp", "4")
        assert abs(sharded["parameters"] - params / 4) <= 0.1 * params / 4
        assert abs(sharded["optimizer"] - base["optimizer"] / 4) <= 0.1 * base["optimizer"] / 4


def test_plan_memory_names_a_bad_model(tmp_path):
    out = run("-m", "prime_rl.trainer.gpu.plan_memory", "--model", str(tmp_path / "nothing"))
    assert out.returncode == 2
    assert "plan-memory: error: --model" in out.stderr and "Traceback" not in out.stderr
