"""A checkpoint folder that someone else could write runs none of their code when a trainer resumes
from it: every pickled payload in it (DCP's metadata and items, the rank file) is refused unless it
is checkpoint state, in one line, before anything it names is called."""

import io
import os
import pickle

import pytest
import torch

from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.rl.trainer import Trainer
from prime_rl.trainer.weights.checkpoint import Checkpointer, CheckpointError
from prime_rl.trainer.weights.no_pickle import SafePlanner


class Planted:
    """Unpickling this makes a folder: the trace of code that ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


@pytest.fixture
def saved(tiny_model, tmp_path):
    world = World()
    trainer = Trainer(TrainerConfig(model={"name": str(tiny_model)}, seq_len=128, output_dir=tmp_path), world)
    path = checkpointer(trainer, world, tmp_path / "ckpt").save(1)
    return trainer, world, path


def checkpointer(trainer, world, root) -> Checkpointer:
    return Checkpointer(root, world, 2, trainer.model, trainer.optimizer, trainer.scheduler)


def load(trainer, world, path):
    checkpointer(trainer, world, path.parent).load(1)


def test_an_untouched_checkpoint_loads(saved):
    load(*saved)


@pytest.mark.parametrize("target", ["rank_0.pt", ".metadata"])
def test_a_planted_payload_is_refused_before_it_runs(saved, tmp_path, target):
    trainer, world, path = saved
    marker = tmp_path / "ran"
    with (path / target).open("wb") as f:
        if target == "rank_0.pt":
            torch.save({"scheduler": Planted(marker)}, f)
        else:
            pickle.dump(Planted(marker), f)
    with pytest.raises(CheckpointError, match="holds a pickled object that is not checkpoint state") as e:
        load(trainer, world, path)
    assert "mkdir" in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()


def test_dcp_items_are_loaded_weights_only(tmp_path):
    buffer = io.BytesIO()
    torch.save(Planted(tmp_path / "ran"), buffer)
    buffer.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        SafePlanner().load_bytes(None, buffer)
    assert not (tmp_path / "ran").exists()


def test_a_refusal_is_told_apart_by_its_type_not_by_torchs_wording(saved, tmp_path, monkeypatch):
    """Were torch to word its weights-only refusal differently, the payload is still refused as not
    checkpoint state (only the global it names is read from torch's message)."""
    trainer, world, path = saved
    marker = tmp_path / "ran"
    torch.save({"scheduler": Planted(marker)}, path / "rank_0.pt")
    real = torch.load

    def reworded(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        except pickle.UnpicklingError:
            raise pickle.UnpicklingError("refused (worded by a later torch)") from None

    monkeypatch.setattr(torch, "load", reworded)
    with pytest.raises(
        CheckpointError, match="not checkpoint state \\(it names a global torch's weights-only"
    ):
        load(trainer, world, path)
    assert not marker.exists()


def test_an_assertion_failing_in_our_code_is_not_reported_as_a_bad_checkpoint(saved, monkeypatch):
    """Only DCP's own assertions about a checkpoint become a CheckpointError; a bug surfaces as itself."""
    import prime_rl.trainer.weights.checkpoint as checkpoint

    def broken(*args, **kwargs):
        raise AssertionError("a bug in the trainer")

    monkeypatch.setattr(checkpoint, "set_state_dict", broken)
    with pytest.raises(AssertionError, match="a bug in the trainer"):
        load(*saved)
