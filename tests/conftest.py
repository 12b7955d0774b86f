"""Shared fixtures: the tiny model is built once per test session (it takes ~10 s)."""

import os
import sys
from pathlib import Path

import pytest

# One torch (OpenMP) thread in the tests and the processes they start, unless they set their own (as
# `rl` does for its trainer): the models here are tiny, and with another process busy on the other
# core (a server, another rank, another job on the machine) two threads spent their time waiting on
# each other: a tiny trainer step took 1-3 s instead of 0.02 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Test-only verifiers environments and plugins (importable by name, as users' packages would be).
sys.path.insert(0, str(Path(__file__).parent / "envs"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from prime_rl.model.tiny import TinyModelConfig, make_tiny_model

    return make_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory) -> Path:
    """The tiny model as a mixture of experts (`make-tiny-model --preset tiny-moe`), random weights."""
    from prime_rl.model.tiny import TinyModelConfig, make_tiny_model

    return make_tiny_model(
        TinyModelConfig(output=tmp_path_factory.mktemp("models") / "tiny-moe", preset="tiny-moe")
    )


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
