"""`plan(config, machine)`: what `rl` starts on a machine and how the processes are wired, on its
own (no process starts, nothing is written). The machine is given by hand."""

import importlib.metadata
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from prime_rl.config.defaults import DEFAULT_MODEL
from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.machine import Machine
from prime_rl.launcher.plan import plan
from prime_rl.launcher.wiring import policy_servers

MACHINE = Machine(
    cpus=(0, 1), cpu_build=True, run_dir=Path("/runs/exp"), run_id="exp-0123abcd", broadcast_port=40001,
    master_port=40002,
)  # fmt: skip
DISTILL = {"orchestrator": {"filters": []}, "trainer": {"advantage": {"type": "reinforce"}}}
NODES = [
    {"host": "10.0.0.1", "roles": ["inference", "orchestrator"]},
    {"host": "10.0.0.2", "roles": ["inference"]},
    {"host": "10.0.0.3", "roles": ["trainer"]},
    {"host": "10.0.0.4", "roles": ["trainer"]},
]
BIN = Path(sys.executable).parent


def at(config: RLConfig, **facts):
    """The plan of `config` on MACHINE, with some of its facts changed."""
    return plan(config, replace(MACHINE, **facts))


def test_one_machine_runs_one_server_a_trainer_and_an_orchestrator_wired_to_each_other(tmp_path):
    out = tmp_path / "run"
    p = at(RLConfig(output_dir=out))
    assert p.roles == {"inference", "orchestrator", "trainer"} and p.world_size == 1
    [server] = p.servers
    assert (server.name, server.group, server.url) == ("inference", "policy", "http://127.0.0.1:8000")
    assert server.config == p.inference and server.log_path == out / "logs" / "inference.log"
    assert server.command[server.command.index("--port") + 1] == "8000"
    configs = {name: out / "configs" / f"{name}.toml" for name in ("inference", "orchestrator", "trainer")}
    assert p.config_files == {configs["inference"]: p.inference, configs["orchestrator"]: p.orchestrator,
                              configs["trainer"]: p.trainer}  # fmt: skip
    trainer, orchestrator = p.workers
    assert trainer.command == [str(BIN / "trainer"), "@", str(configs["trainer"])]
    assert orchestrator.command == [str(BIN / "orchestrator"), "@", str(configs["orchestrator"])]
    assert (trainer.log_path, orchestrator.log_path) == (
        out / "logs" / "trainer.log",
        out / "logs" / "orchestrator.log",
    )
    assert trainer.restart_args == ("--ckpt.resume-step", "-1") and orchestrator.restart_args == (
        "--resume",
        "true",
    )
    # The hand-downs: where to sample, how many ranks to feed, one run id on both ends, resume.
    assert (
        p.orchestrator.client.base_urls == ["http://127.0.0.1:8000/v1"] and p.orchestrator.trainer_ranks == 1
    )
    assert p.run_id == p.orchestrator.transport.run_id == p.trainer.transport.run_id == "exp-0123abcd"
    assert p.trainer.transport == p.orchestrator.transport
    assert p.trainer.ckpt.resume_step == -1
    assert not out.exists()  # planning writes nothing


def test_a_run_id_or_resume_step_the_config_sets_wins_over_the_plans():
    p = at(RLConfig(trainer={"transport": {"run_id": "mine"}, "ckpt": {"resume_step": 3}}))
    assert p.run_id == p.orchestrator.transport.run_id == p.trainer.transport.run_id == "mine"
    assert p.trainer.ckpt.resume_step == 3
    assert at(RLConfig(orchestrator={"transport": {"run_id": "theirs"}})).trainer.transport.run_id == "theirs"


def test_placement_reaches_every_process_on_two_cores_of_vllm_cpu():
    auto_kv = {"inference": {"kv_cache_memory_bytes": None}}  # vLLM sizes its KV cache (GPU: by a share)
    p = at(RLConfig(**auto_kv))  # max_async_level 1: the orchestrator joins vLLM's core
    [server], (trainer, orchestrator) = p.servers, p.workers
    assert (server.cpus, server.env_defaults) == ([0], {"VLLM_CPU_OMP_THREADS_BIND": "0"})
    assert (trainer.cpus, trainer.env, orchestrator.cpus) == ([1], {"OMP_NUM_THREADS": "1"}, [0])
    assert "--gpu-memory-utilization" not in server.command
    p = at(RLConfig(max_async_level=0))
    assert (p.servers[0].cpus, p.workers[0].cpus, p.workers[1].cpus) == (None, [1], None)
    # A CUDA build: nothing pinned, vLLM's compute threads not bound, the GPU's share set.
    p = at(RLConfig(**auto_kv), cpus=(0, 1, 2, 3), cpu_build=False)
    [server], (trainer, orchestrator) = p.servers, p.workers
    assert (server.cpus, server.env_defaults, trainer.cpus, orchestrator.cpus) == (None, {}, None, None)
    assert trainer.env == {"OMP_NUM_THREADS": "4"} and "--gpu-memory-utilization" in server.command


def test_several_servers_on_one_machine_take_consecutive_ports_and_a_slice_of_cores_each():
    p = at(
        RLConfig(inference={"server": {"port": 8100}}, deployment={"inference_servers": 2}), cpus=(0, 1, 2, 3)
    )
    assert [(s.name, s.group, s.url) for s in p.servers] == [
        ("inference-0", "policy", "http://127.0.0.1:8100"), ("inference-1", "policy", "http://127.0.0.1:8101")
    ]  # fmt: skip
    assert [s.cpus for s in p.servers] == [[0], [1]] and p.workers[0].cpus == [2, 3]
    assert [s.env_defaults["VLLM_CPU_OMP_THREADS_BIND"] for s in p.servers] == ["0", "1"]
    assert p.orchestrator.client.base_urls == ["http://127.0.0.1:8100/v1", "http://127.0.0.1:8101/v1"]
    assert p.policy_servers == tuple(s.config for s in p.servers) and p.inference == p.policy_servers[0]


def test_the_teacher_gets_the_port_after_the_policy_servers_its_own_folder_and_the_first_servers_cores(
    tmp_path,
):
    cfg = RLConfig(output_dir=tmp_path, deployment={"inference_servers": 2},
                   teacher={"model": {"name": DEFAULT_MODEL}}, **DISTILL)  # fmt: skip
    p = at(cfg, cpus=(0, 1, 2, 3))
    *_, teacher = p.servers
    assert (teacher.name, teacher.group, teacher.url) == ("teacher", "teacher", "http://127.0.0.1:8002")
    assert teacher.label == f"the teacher ({DEFAULT_MODEL})" and teacher.config == p.teacher
    assert p.teacher.output_dir == tmp_path / "teacher" and p.teacher.lora is None
    assert teacher.cpus == p.servers[0].cpus == [0] and teacher.env_defaults == {
        "VLLM_CPU_OMP_THREADS_BIND": "0"
    }
    assert p.orchestrator.teacher.base_url == "http://127.0.0.1:8002/v1"
    assert p.orchestrator.teacher.model == DEFAULT_MODEL
    assert p.orchestrator.client.base_urls == ["http://127.0.0.1:8000/v1", "http://127.0.0.1:8001/v1"]
    cfg = RLConfig(output_dir=tmp_path, deployment={"inference_servers": 2, "teacher_cpus": [3]},
                   teacher={"model": {"name": DEFAULT_MODEL}}, **DISTILL)  # fmt: skip
    teacher = at(cfg, cpus=(0, 1, 2, 3)).servers[-1]
    assert teacher.cpus == [3] and teacher.env_defaults == {"VLLM_CPU_OMP_THREADS_BIND": "3"}
    assert at(RLConfig(**DISTILL)).teacher is None and at(RLConfig(**DISTILL)).orchestrator.teacher is None


def test_a_multi_node_deployment_wires_every_server_rank_and_address():
    cfg = RLConfig(deployment={"nodes": NODES, "node": 2, "inference_servers": 2, "trainer_ranks": 2},
                   inference={"server": {"port": 8100}}, teacher={"model": {"name": DEFAULT_MODEL}}, **DISTILL)  # fmt: skip
    p = at(cfg)
    assert p.roles == {"trainer"} and p.world_size == 4
    inference, orch, trainer = p.inference, p.orchestrator, p.trainer
    assert orch.client.base_urls == [
        "http://10.0.0.1:8100/v1", "http://10.0.0.1:8101/v1", "http://10.0.0.2:8100/v1", "http://10.0.0.2:8101/v1"
    ]  # fmt: skip
    assert orch.trainer_ranks == 4
    assert orch.transport.host == trainer.transport.host == "10.0.0.1"  # where the orchestrator binds
    assert orch.teacher.base_url == "http://10.0.0.1:8102/v1"  # after the policy servers
    assert [s.server.host for s in policy_servers(cfg, "10.0.0.2")] == ["10.0.0.2", "10.0.0.2"]
    assert inference.server.port == 8100
    # The weight broadcast goes to every server; its store is on trainer rank 0's node: with several
    # trainer nodes torchrun says which (MASTER_ADDR), with one it is that node.
    broadcast = {"trainer": {**DISTILL["trainer"], "weight_broadcast": {"type": "collective"}}}
    cfg = RLConfig(deployment={"nodes": NODES, "inference_servers": 2}, **{**DISTILL, **broadcast})
    wb = at(cfg).trainer.weight_broadcast
    assert wb.servers == [
        "http://10.0.0.1:8000",
        "http://10.0.0.1:8001",
        "http://10.0.0.2:8000",
        "http://10.0.0.2:8001",
    ]
    assert wb.host is None
    one = [NODES[0], NODES[1], NODES[2]]
    assert at(RLConfig(deployment={"nodes": one}, **broadcast)).trainer.weight_broadcast.host == "10.0.0.3"


def test_each_node_starts_its_own_part_and_only_the_first_inference_node_the_teacher(tmp_path):
    def node(i: int):
        return at(RLConfig(output_dir=tmp_path, deployment={"nodes": NODES, "node": i, "inference_servers": 2},
                           teacher={"model": {"name": DEFAULT_MODEL}}, **DISTILL))  # fmt: skip

    first, second, trainer = node(0), node(1), node(2)
    assert [s.url for s in first.servers] == [
        "http://10.0.0.1:8000",
        "http://10.0.0.1:8001",
        "http://10.0.0.1:8002",
    ]
    assert [w.name for w in first.workers] == ["orchestrator"]
    assert [s.url for s in second.servers] == ["http://10.0.0.2:8000", "http://10.0.0.2:8001"]  # no teacher
    assert second.workers == () and trainer.servers == ()
    assert [w.name for w in trainer.workers] == ["trainer"]
    # Each node writes its own configs and logs into the output dir they share; all plan the same wiring.
    assert first.log_dir == tmp_path / "logs" / "node0" and trainer.log_dir == tmp_path / "logs" / "node2"
    assert {path.parent for path in second.config_files} == {tmp_path / "configs" / "node1"}
    assert first.orchestrator == second.orchestrator == trainer.orchestrator
    assert first.trainer == trainer.trainer


def test_servers_bound_to_every_interface_are_reached_at_their_nodes_address():
    cfg = RLConfig(deployment={"nodes": NODES, "node": 1}, inference={"server": {"host": "0.0.0.0"}})
    p = at(cfg)
    assert [s.config.server.host for s in p.servers] == ["0.0.0.0"]
    assert p.servers[0].url == "http://127.0.0.1:8000"  # its health, from its own machine
    assert p.orchestrator.client.base_urls == ["http://10.0.0.1:8000/v1", "http://10.0.0.2:8000/v1"]


def test_the_trainer_command_on_one_machine_and_on_each_trainer_node(tmp_path):
    cfg = tmp_path / "configs" / "trainer.toml"
    assert at(RLConfig(output_dir=tmp_path)).workers[0].command[-2:] == ["@", str(cfg)]
    ranks = at(RLConfig(output_dir=tmp_path, deployment={"trainer_ranks": 2})).workers[0].command
    args = dict(zip(ranks[3::2], ranks[4::2], strict=False))
    assert ranks[1:3] == ["-m", "prime_rl.trainer.parallel.torchrun"] and args["--nproc-per-node"] == "2"
    assert (args["--master-addr"], args["--master-port"]) == ("127.0.0.1", str(MACHINE.master_port))
    nodes = [{"host": "10.0.0.1", "roles": ["inference", "orchestrator"]},
             {"host": "10.0.0.2", "roles": ["trainer"]}, {"host": "10.0.0.3", "roles": ["trainer"]}]  # fmt: skip
    for node, is_host in ((1, 1), (2, 0)):
        config = RLConfig(
            output_dir=tmp_path,
            deployment={"nodes": nodes, "node": node, "trainer_ranks": 4, "rendezvous_port": 29411},
        )
        cmd = at(config, run_id="run-7").workers[0].command
        args = dict(zip(cmd[3::2], cmd[4::2], strict=False))
        assert cmd[1:3] == ["-m", "prime_rl.trainer.parallel.torchrun"]
        assert args["--nproc-per-node"] == "4" and args["--nnodes"] == "2"
        assert args["--rdzv-backend"] == "c10d" and args["--rdzv-endpoint"] == "10.0.0.2:29411"
        assert args["--rdzv-id"] == "run-7" and args["--rdzv-conf"] == f"is_host={is_host}"
        assert args["--local-addr"] == f"10.0.0.{node + 1}"
        cfg = tmp_path / "configs" / f"node{node}" / "trainer.toml"
        assert cmd[-3:] == [str(Path(sys.executable).parent / "trainer"), "@", str(cfg)]


def test_context_parallelism_gives_the_orchestrator_data_parallel_ranks():
    cfg = RLConfig(
        deployment={"nodes": NODES, "node": 2, "trainer_ranks": 2}, trainer={"parallel": {"cp": 2}}
    )
    p = at(cfg)
    orch, trainer = p.orchestrator, p.trainer
    assert p.world_size == 4 and trainer.parallel.cp == 2
    assert orch.trainer_ranks == 2  # two replicas of two context-parallel ranks each
    with pytest.raises(ValueError, match=r"'trainer.parallel.cp' = 3 does not divide the 4 trainer ranks"):
        RLConfig(deployment={"nodes": NODES, "trainer_ranks": 2}, trainer={"parallel": {"cp": 3}})


def test_the_collective_broadcast_on_one_machine_takes_the_machines_free_port_unless_set():
    wb = at(RLConfig(trainer={"weight_broadcast": {"type": "collective"}})).trainer.weight_broadcast
    assert (wb.servers, wb.port, wb.host) == (["http://127.0.0.1:8000"], MACHINE.broadcast_port, None)
    set_port = RLConfig(trainer={"weight_broadcast": {"type": "collective", "port": 29999}})
    assert at(set_port).trainer.weight_broadcast.port == 29999
    assert at(RLConfig()).trainer.weight_broadcast.servers == []  # filesystem: nothing to wire


def test_rl_serves_and_samples_the_trainers_adapter(tiny_model, tmp_path):
    config = RLConfig(model=str(tiny_model), output_dir=tmp_path / "run-a", trainer={"lora": {"rank": 16}})
    p = at(config, run_dir=tmp_path / "run-a")
    inference, orchestrator, trainer = p.inference, p.orchestrator, p.trainer
    assert (
        inference.lora is not None and inference.lora.max_rank == 16
    )  # the smallest rank vLLM takes that holds it
    assert orchestrator.lora_adapter == "run-a" and trainer.lora.rank == 16
    assert all(s.lora == inference.lora for s in p.policy_servers)
    assert "--enable-lora" in p.servers[0].command
    full = at(RLConfig(model=str(tiny_model), output_dir=tmp_path / "run-b"), run_dir=tmp_path / "run-b")
    assert full.inference.lora is None and full.orchestrator.lora_adapter is None
    # The adapter is named after the run folder as the machine resolves it, not as the config spells it.
    dot = RLConfig(model=str(tiny_model), output_dir=".", trainer={"lora": {"rank": 8}})
    assert at(dot, run_dir=Path("/runs/exp-3")).orchestrator.lora_adapter == "exp-3"
    assert at(dot, run_dir=Path("/")).orchestrator.lora_adapter == "run"


def test_rl_on_a_running_server_starts_no_inference(tiny_model, tmp_path):
    config = RLConfig(
        model=str(tiny_model),
        output_dir=tmp_path / "run-a",
        trainer={"lora": {"rank": 8}},
        orchestrator={"lora_adapter": "alice"},
        deployment={"inference_urls": ["http://10.0.0.5:8000/v1", "http://10.0.0.6:8000"]},
    )
    p = at(config)
    orchestrator = p.orchestrator
    assert orchestrator.client.base_urls == ["http://10.0.0.5:8000/v1", "http://10.0.0.6:8000/v1"]
    assert orchestrator.lora_adapter == "alice"
    assert p.roles == {"orchestrator", "trainer"}
    assert (
        p.servers == ()
        and p.policy_servers == ()
        and [w.name for w in p.workers] == ["trainer", "orchestrator"]
    )


def test_planning_reads_nothing_starts_nothing_and_gives_the_same_plan_twice(tmp_path, monkeypatch):
    trainer = {**DISTILL["trainer"], "weight_broadcast": {"type": "collective"}}
    cfg = RLConfig(output_dir=tmp_path / "run", deployment={"inference_servers": 2, "trainer_ranks": 2},
                   trainer=trainer, orchestrator=DISTILL["orchestrator"], teacher={"model": {"name": DEFAULT_MODEL}})  # fmt: skip

    def refused(*args, **kwargs):
        raise AssertionError("plan looked at the machine")

    for owner, name in ((os, "sched_getaffinity"), (socket, "socket"), (importlib.metadata, "distribution"),
                        (os.path, "realpath"), (subprocess, "Popen"), (Path, "mkdir"), (Path, "write_text")):  # fmt: skip
        monkeypatch.setattr(owner, name, refused)
    assert at(cfg) == at(cfg)
    assert not (tmp_path / "run").exists()


def test_servers_return_routes_when_the_machine_says_the_policy_is_a_mixture_of_experts():
    """The plan reads no file: whether the policy has experts is a machine fact, read by `here`."""
    config = RLConfig(orchestrator={"return_routes": True})
    assert at(config, policy_experts=8).inference.return_routes
    assert not at(config, policy_experts=0).inference.return_routes  # dense: nothing to return
    off = RLConfig(orchestrator={"return_routes": False})
    assert not at(off, policy_experts=8).inference.return_routes  # not asked for


def test_the_orchestrator_waits_for_the_servers_at_least_as_long_as_rl_does():
    """It starts with the servers and waits for their health: a longer `startup_timeout_s` (a big
    model) must not make it give up first; a longer wait of its own is kept."""
    slow = at(RLConfig(deployment={"startup_timeout_s": 1800}))
    assert slow.orchestrator.client.health_timeout_s == 1800
    patient = at(RLConfig(orchestrator={"client": {"health_timeout_s": 3600}}))
    assert patient.orchestrator.client.health_timeout_s == 3600


def test_engine_mode_starts_no_policy_server_and_gives_the_orchestrator_the_engine_and_its_cores(tmp_path):
    cfg = RLConfig(output_dir=tmp_path, deployment={"inference_mode": "engine"})
    p = at(cfg)
    assert p.servers == () and p.policy_servers == ()
    assert p.orchestrator.engine == p.inference  # the `[inference]` section, as a server would get it
    trainer, orchestrator = p.workers
    # The orchestrator's process holds vLLM's engine: vLLM's threads bound to the inference core, the
    # front end on the trainer's core, the trainer's one thread wherever a core is idle.
    assert (trainer.cpus, trainer.env, orchestrator.cpus) == (None, {"OMP_NUM_THREADS": "1"}, [1])
    assert orchestrator.env == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    # Pinned on request: the inference core.
    pinned = at(
        RLConfig(output_dir=tmp_path, deployment={"inference_mode": "engine", "pin_orchestrator": True})
    )
    assert pinned.workers[1].cpus == [0] and pinned.workers[1].env == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    # The server mode's plan keeps its server and an orchestrator without an engine, pinned.
    server = at(RLConfig(output_dir=tmp_path, deployment={"inference_mode": "server"}))
    assert server.orchestrator.engine is None and server.workers[1].cpus == [0]
    # A teacher is still a server of its own.
    p = at(RLConfig(output_dir=tmp_path, deployment={"inference_mode": "engine"},
                    teacher={"model": {"name": DEFAULT_MODEL}}, **DISTILL))  # fmt: skip
    assert [s.name for s in p.servers] == ["teacher"] and p.orchestrator.engine is not None
