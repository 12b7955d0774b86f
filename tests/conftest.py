"""Shared fixtures: the tiny model is built once per test session (it takes ~10 s)."""

import sys
from pathlib import Path

import pytest

# Test-only verifiers environments and plugins (importable by name, as users' packages would be).
sys.path.insert(0, str(Path(__file__).parent / "envs"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from prime_rl.model.tiny import TinyModelConfig, make_tiny_model

    return make_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("models") / "tiny"))


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
