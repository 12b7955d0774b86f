"""Shared fixtures: the tiny model is built once per test session (it takes ~10 s)."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from prime_rl.model.tiny import TinyModelConfig, make_tiny_model

    return make_tiny_model(TinyModelConfig(output=tmp_path_factory.mktemp("models") / "tiny"))
