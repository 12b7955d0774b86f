"""Fixtures shared by unit test modules."""

import pytest
from trainer_grad_test import run_worker


@pytest.fixture(scope="session")
def one_rank_gae(tiny_model, tmp_path_factory) -> dict:
    """One rank's gradients and metrics of the grad worker's batch under GAE with a critic, KL in the
    reward and whitening: the reference of both the two-rank and the dp x cp runs (one worker run)."""
    return run_worker(tiny_model, tmp_path_factory.mktemp("gae") / "one.pt", 1, 0, "gae")
