"""Micro-batches from outside the trainer are checked against the model before they reach it: a
token id outside the vocabulary or a position outside the context is one line naming the
micro-batch and the env (on a GPU it would be a device assert that loses the process)."""

import sys
from pathlib import Path

import numpy as np
import pytest

from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.data import OutsideTheModel
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.rl.trainer import Trainer
from prime_rl.transport.messages import ID_DTYPE

sys.path.insert(0, str(Path(__file__).parent))
from trainer_test import micro_batches


@pytest.fixture(scope="module")
def trainer(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("ids")
    return Trainer(TrainerConfig(model={"name": str(tiny_model)}, seq_len=128, output_dir=out), World())


def with_value(mb, field: str, token: int, value: int):
    values = np.frombuffer(getattr(mb, field), dtype=ID_DTYPE).copy()
    values[token] = value
    setattr(mb, field, values.tobytes())
    return mb


@pytest.mark.parametrize(
    ("field", "value", "phrase"),
    [
        ("input_ids", 10**6, "vocabulary"),
        ("input_ids", -1, "vocabulary"),
        ("position_ids", 10**6, "positions"),
    ],
)
def test_an_id_outside_the_model_is_one_line_naming_the_micro_batch(trainer, field, value, phrase):
    mbs = micro_batches(0, "ids")
    bad = with_value(mbs[0], field, 5, value)
    with pytest.raises(OutsideTheModel) as e:
        trainer.train_step([bad])
    text = str(e.value)
    assert f"micro-batch {bad.index} of step 0" in text and f"{field}[5] = {value}" in text, text
    assert phrase in text and "env '" in text and "\n" not in text
    trainer.train_step(micro_batches(0, "ids"))  # the trainer itself is unharmed


def test_a_micro_batch_far_ahead_of_the_trainer_is_refused_not_kept():
    """A sender cannot fill the trainer's memory with steps it will never reach: over zmq, a
    micro-batch more than MAX_STEPS_AHEAD steps ahead is one line; nearer ones wait for their step."""
    from prime_rl.runtime.net import free_port
    from prime_rl.trainer.data import MAX_STEPS_AHEAD, BadMicroBatch, StepReceiver
    from prime_rl.transport.contract import TrainerSide
    from prime_rl.transport.zmq_transport import ZmqReceiver, ZmqSender

    address = f"tcp://127.0.0.1:{free_port()}"
    sender = ZmqSender(address, timeout_s=30)
    receiver = ZmqReceiver(address, "far", timeout_s=30)
    try:
        for step in (3, MAX_STEPS_AHEAD + 1):
            for mb in micro_batches(step, "far"):
                sender.send(mb)
        steps = StepReceiver(receiver, seq_len=128, side=TrainerSide(128, 1))
        with pytest.raises(
            BadMicroBatch, match=f"step {MAX_STEPS_AHEAD + 1} arrived while the trainer is at step 0"
        ):
            steps.get(0)
    finally:
        sender.close(linger_s=0)
        receiver.close()
