"""The loss normalization contract: one global batch gives the same gradients on 1 rank and on 2
ranks (gloo, FSDP2), however unevenly its tokens are split between the ranks."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prime_rl.net import free_port

WORKER = str(Path(__file__).parents[1] / "helpers" / "grad_worker.py")


def run_worker(model: Path, out: Path, ranks: int, split: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if ranks == 1:
        cmd = [sys.executable, WORKER, str(model), str(out), str(split)]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), WORKER, str(model), str(out), str(split)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def single_rank(tiny_model, tmp_path_factory):
    return run_worker(tiny_model, tmp_path_factory.mktemp("g") / "one.pt", ranks=1, split=0)


@pytest.mark.parametrize("split", [6, 11])  # even-ish, and 11 samples vs 1
def test_two_ranks_give_the_same_gradients_as_one(tiny_model, tmp_path, single_rank, split):
    two = run_worker(tiny_model, tmp_path / "two.pt", ranks=2, split=split)
    assert two["global_tokens"] == single_rank["global_tokens"]
    for name, g1 in single_rank["grads"].items():
        g2 = two["grads"][name]
        assert g1.abs().max() > 0, name
        torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-6, msg=f"gradient of {name} differs")
    # Per-env token metrics reduced over the ranks equal those of one rank (the ranks hold different
    # envs' samples, in different orders).
    one, both = single_rank["metrics"], two["metrics"]
    assert set(both) == set(one) and "mismatch_kl/a/mean" in one and "entropy/b/max" in one
    for key, value in one.items():
        assert abs(both[key] - value) <= 1e-6 * max(1.0, abs(value)), key
