"""The trainer's Publisher (`trainer/weights/publish.py`): each step's folder holds the weights as
they were when `publish` returned, though training changes them while the folder is written, and
the host buffers those weights are copied into are reused from step to step."""

import threading

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from prime_rl.runtime.layout import step_dir
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.weights import publish
from prime_rl.trainer.weights.publish import Publisher


def bump(model: torch.nn.Module, by: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(by)


def test_each_step_holds_the_weights_of_its_publish_while_writes_lag_behind(
    tiny_model, tmp_path, monkeypatch
):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    publisher = Publisher(tmp_path, str(tiny_model), World(), keep=5)
    # Hold every write until the next publish has copied its own weights: the write in flight then
    # reads its buffer while the next step's weights are being staged, as under a fast trainer.
    staged = threading.Semaphore(0)
    write = publish.save_file

    def held_write(*args, **kwargs):
        assert staged.acquire(timeout=60), "the next publish never staged its weights"
        write(*args, **kwargs)

    stage, stages = publisher._stage, []

    def stage_and_release(state):
        out = stage(state)
        if stages:  # the write of the step before may go on now
            staged.release()
        stages.append(1)
        return out

    monkeypatch.setattr(publish, "save_file", held_write)
    monkeypatch.setattr(publisher, "_stage", stage_and_release)
    expected = {}
    try:
        for step in (1, 2, 3):
            publisher.publish(model, step)
            expected[step] = model.model.norm.weight.detach().clone()
            bump(model, 1.0)  # the next step's training changes the parameters at once
    finally:
        staged.release()  # nothing follows the last publish: its write goes on
        publisher.close()
    for step, norm in expected.items():
        written = load_file(step_dir(tmp_path / "weights", step) / "model.safetensors")
        assert torch.equal(written["model.norm.weight"], norm), f"step {step} holds another step's weights"


def test_the_staging_buffers_are_reused_from_step_to_step(tiny_model, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    publisher = Publisher(tmp_path, str(tiny_model), World(), keep=2)
    addresses = []
    try:
        for step in range(1, 5):
            publisher.publish(model, step)
            publisher.wait()
            addresses.append(publisher._staging[(step - 1) % 2]["model.norm.weight"].data_ptr())
            bump(model, 0.5)
    finally:
        publisher.close()
    assert addresses[0] == addresses[2] and addresses[1] == addresses[3] and addresses[0] != addresses[1]
    assert not any(p.data_ptr() in addresses for p in model.parameters())  # copies, not the live weights
