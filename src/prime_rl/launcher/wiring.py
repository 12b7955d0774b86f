"""The configs `rl` hands its processes, from its one config: each policy server's and the teacher's,
the orchestrator's and the trainer's, and the addresses at which they reach one another (`plan.py`
puts them together with commands, cores and logs).

Invariant: pure functions of the config (and of `Machine`'s facts handed in): the same inputs give
the same configs on every node, which is how several machines agree without talking.
"""

from __future__ import annotations

from pathlib import Path

from prime_rl.inference.config import LORA_RANKS, InferenceConfig, ServeLoRAConfig, ServerConfig
from prime_rl.launcher.config import DeploymentConfig, RLConfig
from prime_rl.launcher.machine import Machine
from prime_rl.orchestrator.config import OrchestratorConfig
from prime_rl.orchestrator.envs_config import TeacherConfig
from prime_rl.trainer.config import TrainerConfig
from prime_rl.transport.config import TransportConfig

WILDCARD = ("0.0.0.0", "::")
"""Bind addresses that mean every interface: a client reaches such a server at its machine's address."""


def roles(d: DeploymentConfig) -> frozenset[str]:
    """What runs on this machine."""
    if d.inference_urls:
        return frozenset({"orchestrator", "trainer"})
    return frozenset(d.nodes[d.node].roles if d.nodes else ("inference", "orchestrator", "trainer"))


def hosts(d: DeploymentConfig, role: str) -> list[str]:
    """The hosts with `role`, in `nodes` order (one machine: loopback)."""
    return [n.host for n in d.nodes if role in n.roles] if d.nodes else ["127.0.0.1"]


def bind_host(server: ServerConfig, node_host: str, d: DeploymentConfig) -> str:
    # On several machines a server must listen where the orchestrator reaches it.
    return server.host if "host" in server.model_fields_set or not d.nodes else node_host


def reach_host(bind_host: str, node_host: str) -> str:
    return node_host if bind_host in WILDCARD else bind_host


def served(config: RLConfig, policy_experts: int) -> InferenceConfig:
    """`inference`, serving LoRA at a rank that holds the trainer's adapter when it trains one, and
    returning routes when the orchestrator carries them (a MoE, `policy_experts` > 0, with
    `orchestrator.return_routes`)."""
    update = {}
    if config.orchestrator.return_routes and policy_experts:
        update["return_routes"] = True
    lora = config.trainer.lora
    if lora is not None and config.inference.lora is None:
        update["lora"] = ServeLoRAConfig(max_rank=next(r for r in LORA_RANKS if r >= lora.rank))
    return config.inference.model_copy(update=update) if update else config.inference


def policy_servers(config: RLConfig, host: str, policy_experts: int = 0) -> list[InferenceConfig]:
    """The policy servers of the inference machine at `host`, one port each."""
    s, base = config.inference.server, served(config, policy_experts)
    bind = bind_host(s, host, config.deployment)
    return [
        base.model_copy(update={"server": s.model_copy(update={"host": bind, "port": s.port + i})})
        for i in range(config.deployment.inference_servers)
    ]


def teacher_server(config: RLConfig) -> InferenceConfig | None:
    """The teacher's server, on the first inference machine: its own port (by default the one after
    the policy servers') and run folder, so it shares neither with the policy's."""
    if config.teacher is None:
        return None
    t, d = config.teacher.server, config.deployment
    port = t.port if "port" in t.model_fields_set else config.inference.server.port + d.inference_servers
    host = bind_host(t, hosts(d, "inference")[0], d)
    return config.teacher.model_copy(
        update={
            "server": t.model_copy(update={"port": port, "host": host}),
            "output_dir": Path(config.output_dir) / "teacher",
        }
    )


def orchestrator_config(
    config: RLConfig,
    machine: Machine,
    urls: list[str],
    run_id: str,
    teacher: InferenceConfig | None,
    engine: InferenceConfig | None = None,
) -> OrchestratorConfig:
    d, orch = config.deployment, config.orchestrator
    transport = orch.transport.model_copy(update={"run_id": run_id})
    if d.nodes and "host" not in transport.model_fields_set:
        transport = transport.model_copy(update={"host": hosts(d, "orchestrator")[0]})
    pool = orch.pool
    if d.nodes and "host" not in pool.model_fields_set:  # servers of other machines join there
        pool = pool.model_copy(update={"host": hosts(d, "orchestrator")[0]})
    adapter = orch.lora_adapter or ((machine.run_dir.name or "run") if config.trainer.lora else None)
    update = {
        # It starts with the servers and waits for them: at least as long as rl does.
        "client": orch.client.model_copy(
            update={
                "base_urls": urls,
                "health_timeout_s": max(orch.client.health_timeout_s, d.startup_timeout_s),
                "max_restarts": orch.client.max_restarts
                if "max_restarts" in orch.client.model_fields_set
                else d.max_restarts,
            }
        ),
        # The orchestrator sends each data-parallel replica its batches; a replica is cp ranks.
        "trainer_ranks": config.dp,
        "transport": transport,
        "pool": pool,
        "lora_adapter": adapter,
        "engine": engine,
    }
    if teacher is not None:
        host = reach_host(teacher.server.host, hosts(d, "inference")[0])
        update["teacher"] = (orch.teacher or TeacherConfig()).model_copy(
            update={"base_url": f"http://{host}:{teacher.server.port}/v1", "model": teacher.model.name}
        )
    return orch.model_copy(update=update)


def trainer_config(
    config: RLConfig, machine: Machine, urls: list[str], transport: TransportConfig
) -> TrainerConfig:
    d, trainer = config.deployment, config.trainer
    ckpt = trainer.ckpt
    if ckpt.resume_step is None:
        ckpt = ckpt.model_copy(update={"resume_step": -1})  # rerunning the same command resumes
    broadcast = trainer.weight_broadcast
    if broadcast.type == "collective":
        update: dict = {"servers": [u.removesuffix("/v1") for u in urls]}
        if not d.nodes and "port" not in broadcast.model_fields_set:
            update["port"] = machine.broadcast_port  # one machine: any free port will do
        if d.nodes and len(hosts(d, "trainer")) == 1 and "host" not in broadcast.model_fields_set:
            update["host"] = hosts(d, "trainer")[0]  # (several trainer nodes: torchrun's MASTER_ADDR)
        broadcast = broadcast.model_copy(update=update)
    return trainer.model_copy(update={"transport": transport, "ckpt": ckpt, "weight_broadcast": broadcast})
