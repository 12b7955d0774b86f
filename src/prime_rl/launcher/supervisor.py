"""Carry out `rl`'s plan (`plan.py`): start this machine's servers and processes, watch them, stop
them together.

Invariant: `rl` never leaves a process behind. Each child runs in its own process group; when one
fails, or on Ctrl-C / SIGTERM, every group gets SIGTERM and, after a grace period, SIGKILL. The run
succeeds when the orchestrator and the trainer both exit 0. With `deployment.max_restarts` a child
that dies is started again instead (up to that many times each, with back-off; never one that
exited with status 2, an error a restart cannot fix): a server comes back on its port and the
orchestrator loads it with the current weights; a trainer resumes from its checkpoint, and the
orchestrator is restarted with it so that it re-sends the batches from there. Each restart is one
console line and one record in `restarts.jsonl`, which the orchestrator's metrics count.

A child that hangs instead of dying is found by the watchdog (`watchdog.py`, `deployment.
stall_timeout_s`): one line names it, every stack goes to `logs/stall_<step>_<time>.txt`, and the
hung process is killed, so that it is restarted (or stops the run) exactly as if it had died. A hung
env worker is killed alone: the orchestrator starts another in its place.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from prime_rl.auth import tenant
from prime_rl.config.files import write_config
from prime_rl.engine.server import UnsafeFolder, is_healthy, server_env
from prime_rl.launcher.child import Child, start_child
from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.machine import here
from prime_rl.launcher.plan import Plan, Server, plan
from prime_rl.launcher.processes import kill_culprit, kill_tree, process_trees, tree_of
from prime_rl.launcher.watchdog import Watchdog, look, stall_line, waiting_line
from prime_rl.launcher.wiring import hosts
from prime_rl.runtime import activity, secret
from prime_rl.runtime.disk import DiskFull, writing
from prime_rl.runtime.layout import record_restart, restarts_path

GRACE_S = 15.0
CHECK_S = 1.0
"""How often the watchdog reads the processes' activity records."""
WAITING_S = 30.0
"""After this long without any process changing what it does, the console says what each does."""

NEEDS_USER = 2
"""Exit status of an error that a restart would repeat (config, env, disk full): never retried."""
MAX_BACKOFF_S = 60.0


class Launcher:
    def __init__(self, config: RLConfig):
        self.config = config
        self.out = Path(config.output_dir)
        self.children: list[Child] = []
        self.stopping = False
        self.grace_s = GRACE_S
        d = config.deployment
        self.watchdog = Watchdog(
            activity.folder(self.out), d.stall_timeout_s, d.stall_floor_s, d.stall_first_step_s
        )
        self.log_dir = self.out / "logs"
        self._next_waiting_line = 0.0
        self.holding_signals = False
        """While a child is being started: a signal is held until it is in `Child.proc`."""
        self.held_signal: int | None = None

    def _write_configs(self, plan: Plan) -> None:
        folder = next(iter(plan.config_files)).parent
        with writing(folder, "the process configs"):
            folder.mkdir(parents=True, exist_ok=True)
            for path, config in plan.config_files.items():
                write_config(path, config)  # secrets beside it, private (`plan.config_files`)

    def _start(self, *args, **kwargs) -> Child:
        """`start_child`'s child, one of those this launcher stops."""
        with self._signals_held():
            child = start_child(*args, **kwargs)
            self.children.append(child)
        return child

    @contextlib.contextmanager
    def _signals_held(self):
        """A signal that arrives inside is acted on at its end: a child started inside is then held
        where the stop finds it."""
        self.holding_signals = True
        try:
            yield
        finally:
            self.holding_signals = False
        if self.held_signal is not None:
            self.on_signal(self.held_signal)

    def _start_servers(self, servers: tuple[Server, ...], base_env: dict[str, str]) -> list[Child]:
        """This machine's servers, started: `watch` waits until they are healthy."""
        started = []
        for s in servers:
            # The plan's defaults, under the environment's own, under the server's run folders.
            env = {**s.env_defaults, **server_env(s.config, base_env), activity.ENV_LABEL: s.name}
            started.append(self._start(s.name, s.command, env, s.cpus, s.log_path, False, s.group))
            print(f"rl: starting {s.label} at {s.url} ...", flush=True)
        return started

    def _look_at_starting(self, servers: list[Child], starting: dict[str, str], up_by: float) -> int | None:
        """Drop the servers that answer their health route from `starting` (name -> URL); 1, with
        everything stopped, when one of them exited or `startup_timeout_s` passed first."""
        for child in servers:
            url = starting.get(child.name)
            if url is None:
                continue
            if child.proc.poll() is not None:
                why = f"the inference server exited with status {child.proc.returncode} before it was healthy"
            elif is_healthy(url):
                del starting[child.name]
                continue
            elif time.monotonic() > up_by:
                timeout_s = self.config.deployment.startup_timeout_s
                why = f"the inference server at {url} was not healthy after {timeout_s:.0f} s"
            else:
                continue
            print(f"rl: error: {child.name}: {why}; see {child.log_path}", file=sys.stderr, flush=True)
            self.stop_all()
            return 1
        if not starting:
            print("rl: inference is up", flush=True)
            self.watchdog.restarted()  # the run's clock starts once its servers serve
        return None

    def stop_all(self, announce: str | None = None) -> None:
        """SIGTERM every group, SIGKILL what is left after the grace period, reap. Runs once: a
        second call (a second signal arriving mid-stop) returns at once and the first one finishes."""
        if self.stopping:
            return
        self.stopping = True
        if announce:
            print(announce, file=sys.stderr, flush=True)
        self._stop(self.children)

    def on_signal(self, signum: int) -> None:
        """Ctrl-C or SIGTERM: stop every child, then exit 130 / 143."""
        if self.stopping:
            # A second signal (uv and the shell often both forward one) must not abort the stop in
            # progress by raising inside it: that would orphan whatever it had not yet reaped.
            return
        if self.holding_signals:
            self.held_signal = signum
            return
        self.stop_all(f"\nrl: {signal.Signals(signum).name}, stopping every process ...")
        raise SystemExit(130 if signum == signal.SIGINT else 143)

    def _stop(self, children: list[Child]) -> None:
        # Taken before the stop: once torchrun is gone, its ranks are nobody's descendants.
        trees = {id(c): tree_of(c.proc.pid) for c in children if c.proc.poll() is None}
        for child in children:
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for child in children:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            kill_tree(child.proc.pid, trees.get(id(child), []))  # what is left, torchrun's ranks too
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
            return len(hosts(d, "trainer")) == 1 and any(c.kind == "orchestrator" for c in self.children)
        return True

    def _restart(self, child: Child, code: int, workers: list[Child]) -> None:
        """Start `child` again after its back-off (with the trainer, the orchestrator too)."""
        d = self.config.deployment
        child.restarts += 1
        wait_s = min(MAX_BACKOFF_S, d.restart_backoff_s * 2 ** (child.restarts - 1))
        also = [w for w in workers if w.kind == "orchestrator"] if child.kind == "trainer" else []
        print(
            f"rl: {child.name} {exit_words(child, code)}; restarting it ({child.restarts} of "
            f"{d.max_restarts}) in {wait_s:.0f} s{', with the orchestrator' if also else ''} "
            f"(see {child.log_path})",
            file=sys.stderr,
            flush=True,
        )
        for other in also:  # an orchestrator that had died on its own is a restart of its own too
            if other.proc.poll() not in (None, 0):
                other.restarts += 1
                self._record(other, other.proc.returncode)
        self._stop([child, *also])  # what is left of its process group, and the orchestrator
        self._record(child, code)
        child.hung = False
        time.sleep(wait_s)
        self.watchdog.restarted()  # the new process gets the first step's time to show progress
        # A signal between starting a child and holding it would leave that child behind: rl's
        # handler waits until the new process is in `c.proc`. Deferred, not blocked: a child
        # inherits its parent's signal mask, and a restarted process then never saw SIGTERM (every
        # stop waited out the grace period and ended it with SIGKILL, its cleanup skipped).
        with self._signals_held():
            for c in (child, *also):
                if not self.stopping:
                    c.proc = c.spawn()

    def _record(self, child: Child, code: int) -> None:
        with writing(restarts_path(self.out), "the restart record"):
            record_restart(self.out, child.kind, child.name, code, child.restarts)

    def run(self) -> int:
        p = plan(self.config, here(self.config))
        self._write_configs(p)
        d = self.config.deployment
        # One folder for every record of the run (a teacher server's output dir is another).
        base_env = {
            **os.environ,
            **run_secret(self.out),
            "PYTHONUNBUFFERED": "1",
            "TOKENIZERS_PARALLELISM": "false",
            activity.ENV_DIR: str(activity.folder(self.out)),
        }
        where = f" (node {d.node}: {', '.join(sorted(p.roles))})" if d.nodes else ""
        print(f"rl: output in {self.out} (logs in {p.log_dir}){where}", flush=True)
        self.log_dir = p.log_dir
        activity.forget_gone(activity.folder(self.out), socket.gethostname())
        servers = self._start_servers(p.servers, base_env)
        # The trainer loads its model and the orchestrator its envs while the servers start (the
        # orchestrator waits for their health itself): on a CPU build the trainer's cores are idle
        # during a vLLM start, and the run's first step comes that much sooner.
        quiet = tuple(s.url for s in p.servers)  # rl says when they are up
        workers = [
            self._start(
                w.name,
                w.command,
                {**base_env, **w.env},
                w.cpus,
                w.log_path,
                True,
                again=w.restart_args,
                quiet=quiet,
            )
            for w in p.workers
        ]
        return self.watch(servers, workers, {c.name: s.url for c, s in zip(servers, p.servers, strict=True)})

    def watch(
        self,
        servers: list[Child],
        workers: list[Child],
        starting: dict[str, str] | None = None,
        poll_s: float = 0.5,
    ) -> int:
        """Wait until every worker (trainer, orchestrator) has exited 0, then stop the servers: 0.
        A worker failing stops everything: that child's status, at least 1. A server serves until rl
        stops it, so one that exits has failed (vLLM's API server exits 0 when its engine dies): the
        run goes on while another server of its group lives (the orchestrator moves the work there),
        and stops when none does; one that fails to start (`starting`: name -> URL, until healthy)
        stops everything. With no workers (an inference-only node) rl serves until stopped."""
        done: set[str] = set()
        starting = dict(starting or {})
        up_by = time.monotonic() + self.config.deployment.startup_timeout_s
        next_check = time.monotonic() + CHECK_S
        while True:
            if starting and (code := self._look_at_starting(servers, starting, up_by)) is not None:
                return code
            for child in servers + workers:
                if child.name in starting:  # its exit is a failed start: looked at above
                    continue
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
                        print(
                            f"rl: {child.name} server exited with status {code} during the run; its work moves to "
                            f"{', '.join(s.name for s in alive)} (see {child.log_path})",
                            file=sys.stderr,
                            flush=True,
                        )
                        continue
                    print(
                        f"rl: {child.name} server exited with status {code} during the run; stopping the others "
                        f"(see {child.log_path})",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.stop_all()
                    return code if code > 0 else 1
                if code != 0:
                    print(
                        f"rl: {child.name} {exit_words(child, code)}; stopping the others (see {child.log_path})",
                        file=sys.stderr,
                        flush=True,
                    )
                    self.stop_all()
                    return code if code > 0 else 1
                done.add(child.name)
            if workers and {w.name for w in workers} <= done:
                self.stop_all()
                print(
                    f"rl: done; metrics in {self.out / 'trainer'} and {self.out / 'orchestrator'}", flush=True
                )
                return 0
            if time.monotonic() >= next_check and not self.stopping and not starting:
                self._watch_for_stall(servers + workers)
                next_check = time.monotonic() + CHECK_S
            time.sleep(poll_s)

    def _watch_for_stall(self, children: list[Child]) -> None:
        """A stalled run (`watchdog.py`): one line, the stacks, and the hung process killed, so that
        the loop restarts it, or stops the run, as for a process that died."""
        live = {c.name: c.proc.pid for c in children if c.proc.poll() is None}
        found_trees = process_trees(list(live.values()))
        trees = {name: found_trees[pid] for name, pid in live.items()}
        found = look(self.watchdog, trees, self.log_dir, socket.gethostname())
        if found is None:
            # A long wait says what everyone is doing, once a while (a stall, or just a long step).
            idle_s = self.watchdog.idle_s()
            if idle_s >= WAITING_S and time.monotonic() >= self._next_waiting_line and self.watchdog.states:
                print(waiting_line(self.watchdog.states, idle_s), flush=True)
                self._next_waiting_line = time.monotonic() + 2 * WAITING_S
            return
        stall, path = found
        print(stall_line(stall, path), file=sys.stderr, flush=True)
        killed = kill_culprit(
            stall.culprit, {c.name: c.proc.pid for c in children if c.proc.poll() is None}, trees
        )
        for child in children:
            child.hung = child.hung or child.name == killed


def exit_words(child: Child, code: int) -> str:
    return "hung and was killed" if child.hung else f"exited with status {code}"


def install_signal_handlers(launcher: Launcher) -> None:
    """Ctrl-C and SIGTERM stop every child, then exit 130 / 143."""

    signal.signal(signal.SIGINT, lambda signum, _: launcher.on_signal(signum))
    signal.signal(signal.SIGTERM, lambda signum, _: launcher.on_signal(signum))


def run_secret(out: Path) -> dict[str, str]:
    """The environment that gives the run's processes its secret: the one this process was given, or
    a file made under the output folder (kept for a resumed run). Never the value itself: a file's
    name in the environment, so that no command line, config file or log holds the secret. (A run
    that is a tenant of a shared server keeps a secret of its own too; its tenant key file, checked
    here, reaches the children in their environment.)"""
    tenant.mine()
    if os.environ.get(secret.ENV) or os.environ.get(secret.FILE_ENV):
        secret.value()  # a bad file is one line now, not a failure in every child
        return {}
    path = secret.create(out)
    os.environ[secret.FILE_ENV] = str(path)  # this process's own clients too
    secret.value.cache_clear()
    return {secret.FILE_ENV: str(path)}


def launch(config: RLConfig) -> int:
    launcher = Launcher(config)
    install_signal_handlers(launcher)
    try:
        return launcher.run()
    except (DiskFull, UnsafeFolder, secret.SecretError) as e:
        print(f"rl: error: {e}", file=sys.stderr, flush=True)
        return NEEDS_USER
    finally:
        launcher.stop_all()
