"""Shared fixtures: the tiny model is built once per test run (it takes ~10 s); every test
fails if it leaves a thread running, a sandbox's tool host or a logging handler on a closed stream
(`_nothing_left_running`)."""

import contextlib
import gc
import logging
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

# One torch (OpenMP) thread in the tests and the processes they start, unless they set their own (as
# `rl` does for its trainer): the models here are tiny, and with another process busy on the other
# core (a server, another rank, another job on the machine) two threads spent their time waiting on
# each other: a tiny trainer step took 1-3 s instead of 0.02 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Test-only verifiers environments and plugins (importable by name, as users' packages would be).
sys.path.insert(0, str(Path(__file__).parent / "envs"))

# No model hub here: a model name that is not a local folder fails at once instead of retrying.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The processes the tests start by hand (a server in one folder, an orchestrator in another) run as
# they did before a secret was the default, on loopback: the explicit opt-out. Tests of the default
# take it away (`tests/integration/by_hand_test.py`); `rl` makes its run's secret regardless.
os.environ.setdefault("PRIME_RL_NO_SECRET", "1")


def _collects(config) -> bool:
    """Whether this process collects the tests: an xdist worker, or a run without workers."""
    return hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None)


def pytest_configure(config) -> None:
    if _collects(config):
        # Collecting imports the test modules and what they import (torch, vLLM, verifiers): with the
        # cyclic collector paused, and what they made frozen at the end, as our processes import
        # (`prime_rl/runtime/imports.py`): they live as long as this process.
        gc.disable()
    # The suite starts some 400 Python processes that import prime_rl, its environments and these
    # tests' helpers from source. Where PYTHONDONTWRITEBYTECODE is set (CI machines set it), none of
    # them saves what it compiled, so each compiled the package again: 0.3-0.4 s of CPU apiece.
    # Compiled once here, before xdist starts its workers (the installed packages are compiled at
    # install: `compile-bytecode` in pyproject.toml); reading the files is allowed under the setting.
    if hasattr(config, "workerinput"):
        return
    import compileall

    root = Path(__file__).parent.parent
    for folder in ("src", "environments", "tests"):
        compileall.compile_dir(root / folder, quiet=1)


def pytest_collection_finish(session) -> None:
    if _collects(session.config):
        gc.freeze()
        gc.enable()


def pytest_unconfigure(config) -> None:
    # Collectable again at exit, as an ordinary process's are (nanobind, in triton, otherwise
    # reports each of its objects as leaked).
    gc.unfreeze()


def pytest_xdist_auto_num_workers(config) -> int:
    # One worker more than cores, at most 6: the suite's processes wait on one another (a server
    # starting, a stall timeout running out, a restart's back-off), so as many workers as cores left
    # the cores idle part of the time. Measured on 2 cores: 83-85% busy with 2 workers, 97% with 3,
    # and the suite 8% shorter. Each worker runs one `rl` run at a time (a few GiB at most).
    return min(len(os.sched_getaffinity(0)) + 1, 6)


LINGER_S = 60.0
"""How long a test's non-daemon threads may take to end after it (a server's or a pool's shutdown
finishing) before the test fails for leaving them behind: a guard against threads that never end,
not a bound on shutdowns, which a loaded machine stretches (the wait ends as the threads do)."""


def _configured_loggers() -> dict[str, logging.Logger]:
    """The loggers that `setup_logging` (run by a test, or by a main it runs) configures: the root,
    prime_rl's and the third-party ones it quiets."""
    from prime_rl.runtime.logging_setup import QUIETED

    found = {"": logging.getLogger(), **{name: logging.getLogger(name) for name in QUIETED}}
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if isinstance(logger, logging.Logger) and (name == "prime_rl" or name.startswith("prime_rl.")):
            found[name] = logger
    return found


def _all_handlers() -> list[tuple[str, logging.Handler]]:
    loggers = [("root", logging.getLogger())] + [
        (name, logger)
        for name, logger in list(logging.Logger.manager.loggerDict.items())
        if isinstance(logger, logging.Logger)
    ]
    return [(name, handler) for name, logger in loggers for handler in list(logger.handlers)]


def _tool_hosts() -> dict[int, str]:
    """This process's descendants that are tool hosts (`prime_rl.sandbox.host`), with their command
    line: an env that is never closed leaves its host running until the process ends."""
    hosts = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            cmdline = proc.cmdline()
        except psutil.Error:
            continue
        if "prime_rl.sandbox.host" in cmdline:
            hosts[proc.pid] = " ".join(cmdline)
    return hosts


def _where(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident)
    return (
        f"{thread.name} (at {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name})"
        if frame
        else thread.name
    )


def _restore_logging(saved: dict[str, tuple[list[logging.Handler], int, bool]]) -> None:
    # A test that runs a process's main in-process sets the root handler to the sys.stderr it sees:
    # under capsys/capfd that stream is closed after the test, and every later record (from any
    # test, any thread) would end in "--- Logging error --- ValueError: I/O operation on closed
    # file". Levels are put back too: a main's levels (prime_rl's INFO, the quieted libraries'
    # WARNING) would otherwise decide what a later test's caplog sees.
    for name, logger in _configured_loggers().items():
        handlers, level, propagate = saved.get(name, ([], logging.NOTSET, True))
        # pytest attaches its capturing handlers around each phase and removes them itself.
        pytests = [h for h in logger.handlers if type(h).__module__.startswith("_pytest")]
        for handler in logger.handlers:
            if handler not in handlers and handler not in pytests:
                handler.close()
        logger.handlers[:] = handlers + [h for h in pytests if h not in handlers]
        logger.setLevel(level)
        logger.propagate = propagate


def _hosts_left(before: dict[int, str], deadline: float) -> dict[int, str]:
    """The tool hosts started during a test that are still running at `deadline` (killed then, so
    that the next test starts without them)."""
    new = {pid: cmd for pid, cmd in _tool_hosts().items() if pid not in before}
    procs = []
    for pid in new:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
    _, alive = psutil.wait_procs(procs, timeout=max(0.0, deadline - time.monotonic()))
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return {proc.pid: new[proc.pid] for proc in alive}


@pytest.fixture(autouse=True)
def _nothing_left_running():
    """Fails a test that leaves a non-daemon thread running, a tool host (an env it never closed), or
    a logging handler writing to a closed stream; puts the loggers that `setup_logging` configures back as they were before it, and
    stops the activity record that a main run in-process started."""
    threads = set(threading.enumerate())
    hosts = _tool_hosts()
    saved = {name: (list(lg.handlers), lg.level, lg.propagate) for name, lg in _configured_loggers().items()}
    activity = sys.modules.get("prime_rl.runtime.activity")
    record = activity and activity._record
    yield
    _restore_logging(saved)
    activity = sys.modules.get("prime_rl.runtime.activity")
    if activity is not None and activity._record is not record:
        # A main run in-process keeps its activity record, and the thread beating it, for the rest
        # of the process: one record per process, so a later test's main would start none.
        activity.stop()
    closed = [
        (name, h) for name, h in _all_handlers() if getattr(getattr(h, "stream", None), "closed", False)
    ]
    for name, handler in closed:
        logging.getLogger(None if name == "root" else name).removeHandler(handler)
    deadline = time.monotonic() + LINGER_S
    left = [t for t in threading.enumerate() if t not in threads and not t.daemon]
    for thread in left:
        thread.join(max(0.0, deadline - time.monotonic()))
    left = [t for t in left if t.is_alive()]
    hosts_left = _hosts_left(hosts, deadline)
    problems = (
        [f"a thread still running {LINGER_S:g} s after the test: {_where(t)}" for t in left]
        + [
            f"a tool host still running (an env not closed): pid {pid}: {cmd}"
            for pid, cmd in hosts_left.items()
        ]
        + [f"logger {name!r} has a handler on a closed stream: {handler!r}" for name, handler in closed]
    )
    if problems:
        pytest.fail("the test left behind:\n  " + "\n  ".join(problems), pytrace=False)


@pytest.fixture(scope="session")
def built_once(tmp_path_factory, request):
    """`built_once(name, build)`: the folder `name` that `build(folder)` fills (given it empty), built
    once per test run however many xdist workers ask for it (pytest-xdist's recipe for session data):
    under a folder of the run's, behind a file lock, the first asker builds it and the others reuse
    it. It is built under another name and renamed when complete, so a build that failed half-way is
    never reused."""
    from filelock import FileLock

    # A worker's basetemp is a folder of the run's; without xdist the session's is the run's.
    root = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):
        root = root.parent

    def built_once(name: str, build: Callable[[Path], object]) -> Path:
        folder = root / name
        with FileLock(root / f"{name}.lock"):
            if not folder.exists():
                partial = root / f"{name}.partial"
                shutil.rmtree(partial, ignore_errors=True)  # what a failed build left
                partial.mkdir()
                build(partial)
                partial.rename(folder)
        return folder

    return built_once


@pytest.fixture(scope="session")
def tiny_model(built_once) -> Path:
    from prime_rl.model.tiny import TinyModelConfig, make_tiny_model

    return built_once("tiny", lambda out: make_tiny_model(TinyModelConfig(output=out)))


@pytest.fixture(scope="session")
def tiny_moe_model(built_once) -> Path:
    """The tiny model as a mixture of experts (`make-tiny-model --preset tiny-moe`), random weights."""
    from prime_rl.model.tiny import TinyModelConfig, make_tiny_model

    return built_once("tiny-moe", lambda out: make_tiny_model(TinyModelConfig(output=out, preset="tiny-moe")))


@pytest.fixture
def short_context_model(tmp_path) -> Path:
    """A model folder allowing 512 positions: the shipped tiny model's config.json only (no weights),
    which is all that config validation reads."""
    import json

    config = json.loads((Path(__file__).parents[1] / "models/reverse_text-tiny/config.json").read_text())
    folder = tmp_path / "short-context-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    return folder


def pytest_terminal_summary(terminalreporter, config) -> None:
    # How many vLLM servers the run started, found in the servers' logs (those `rl` started too),
    # and which were the shared ones (tests/integration/conftest.py). With xdist this runs in the
    # controller, whose temporary folder holds each worker's.
    if hasattr(config, "workerinput") or not terminalreporter.stats:
        return
    starts, shared = 0, []
    for path in config._tmp_path_factory.getbasetemp().rglob("*"):
        if path.name == "shared-vllm-starts.tsv":
            shared += [line.split("\t") for line in path.read_text().splitlines()]
        elif path.suffix in (".log", ".out") and path.is_file():
            with path.open(errors="replace") as f:
                starts += sum("Starting vLLM server on" in line for line in f)
    if not starts:
        return
    terminalreporter.write_sep("-", "vLLM servers")
    terminalreporter.write_line(f"{starts} vLLM server starts in all, {len(shared)} of them shared:")
    for name, seconds in shared:
        terminalreporter.write_line(f"  {name}: healthy after {seconds} s")
