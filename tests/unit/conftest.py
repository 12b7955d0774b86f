"""Fixtures shared by unit test modules."""

import pytest
import torch
from trainer_grad_test import run_worker

from prime_rl.runtime import secret

RUN_SECRET = "the-secret-of-this-run"


@pytest.fixture
def run_secret(monkeypatch) -> str:
    """This process has a run secret (`PRIME_RL_SECRET`); its value."""
    monkeypatch.setenv(secret.ENV, RUN_SECRET)
    monkeypatch.delenv(secret.FILE_ENV, raising=False)
    secret.value.cache_clear()
    yield RUN_SECRET
    secret.value.cache_clear()  # (before monkeypatch restores the environment: read again after it)


@pytest.fixture
def no_secret(monkeypatch) -> None:
    """This process has no run secret."""
    monkeypatch.delenv(secret.ENV, raising=False)
    monkeypatch.delenv(secret.FILE_ENV, raising=False)
    secret.value.cache_clear()
    yield
    secret.value.cache_clear()


@pytest.fixture(scope="session")
def one_rank_gae(tiny_model, built_once) -> dict:
    """One rank's gradients and metrics of the grad worker's batch under GAE with a critic, KL in the
    reward and whitening: the reference of both the two-rank and the dp x cp runs (one worker run per
    test run: the modules that use it may run on different xdist workers)."""
    folder = built_once("one-rank-gae", lambda out: run_worker(tiny_model, out / "one.pt", 1, 0, "gae"))
    return torch.load(folder / "one.pt")
