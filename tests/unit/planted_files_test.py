"""Someone who can write the run folder cannot plant what the run would load or train on: published
weights (a `READY` step of someone else's), file-transport micro-batches and the orchestrator's saved
batches are checked against the run secret first, and refused in one line naming the file."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoModelForCausalLM

from helpers.grad_worker import make_samples
from prime_rl.runtime.layout import MANIFEST, verify_weights
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.weights.publish import Publisher
from prime_rl.transport.base import TransportError
from prime_rl.transport.contract import OrchestratorSide
from prime_rl.transport.file_transport import FileReceiver, FileSender
from prime_rl.transport.packing import pack


@pytest.fixture
def published(tiny_model, tmp_path, run_secret):
    publisher = Publisher(tmp_path, str(tiny_model), World(), keep=3)
    publisher.publish(AutoModelForCausalLM.from_pretrained(tiny_model), 1)
    publisher.close()
    return tmp_path / "weights" / "step_1"


def test_published_weights_carry_a_keyed_manifest_and_planted_ones_are_refused(published, tmp_path):
    assert verify_weights(published) is None and (published / MANIFEST).exists()
    # A planted step: the same files, without (or with a copied) manifest, or changed.
    planted = tmp_path / "weights" / "step_2"
    shutil.copytree(published, planted)
    assert "was saved for step_1, not step_2" in verify_weights(planted)
    (planted / MANIFEST).unlink()
    assert "is missing" in verify_weights(planted)
    weights = published / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert "does not match its keyed hash" in verify_weights(published)


def test_a_planted_micro_batch_is_refused_before_it_is_decoded(tmp_path, run_secret):
    side = OrchestratorSide("s", 256, 1)
    (rank_batches,) = pack(make_samples(4, seed=0), 256, 1, "run", 0, orchestrator=side)
    sender = FileSender(tmp_path)
    for mb in rank_batches:
        sender.send(mb)
    receiver = FileReceiver(tmp_path, "run", timeout_s=5)
    for mb in rank_batches:
        assert receiver.recv().index == mb.index  # the run's own files are taken
    # The same message, planted as the next one (moved), or changed in place.
    first = tmp_path / "step_000000" / "rank_0" / "0000.msgpack"
    nxt = tmp_path / "step_000001" / "rank_0" / "0000.msgpack"
    nxt.parent.mkdir(parents=True)
    shutil.copy(first, nxt)
    with pytest.raises(TransportError, match="not sealed with this run's key"):
        receiver.recv()
