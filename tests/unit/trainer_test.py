"""The trainer as a user runs it: fed over zmq by a test producer, with metrics, token export,
published weights, checkpoints and resume; plus packed-sequence correctness and bad input."""

import json
import logging
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from prime_rl.runtime import secret
from prime_rl.runtime.layout import checkpoint_root, write_manifest
from prime_rl.runtime.net import free_port
from prime_rl.trainer.config import TrainerConfig
from prime_rl.trainer.data import BadMicroBatch, StepReceiver
from prime_rl.trainer.logprobs import forward_logprobs
from prime_rl.trainer.loop import resume
from prime_rl.trainer.main import step_line_extras, train
from prime_rl.trainer.memory import OutOfMemory, advice
from prime_rl.trainer.model import ModelLoadError
from prime_rl.trainer.parallel.dist import World
from prime_rl.trainer.rl.trainer import Trainer
from prime_rl.trainer.run import NaNLossError
from prime_rl.trainer.weights.checkpoint import Checkpointer
from prime_rl.transport.contract import OrchestratorSide, TrainerSide
from prime_rl.transport.file_transport import FileReceiver, FileSender
from prime_rl.transport.messages import Header, MicroBatch, TrainingSample
from prime_rl.transport.packing import pack
from prime_rl.transport.zmq_transport import ZmqSender

TRAINER = str(Path(sys.executable).parent / "trainer")


def samples(step: int, n: int = 8) -> list[TrainingSample]:
    rng = random.Random(step)
    out = []
    for _ in range(n):
        p, c = rng.randint(4, 20), rng.randint(2, 30)
        out.append(
            TrainingSample(
                [rng.randrange(3, 500) for _ in range(p)],
                [rng.randrange(3, 500) for _ in range(c)],
                [1] * c,
                [-6.0] * c,
                advantage=rng.uniform(-1, 1),
                reward=0.0,
                env_name=rng.choice(["rev", "sum"]),
                policy_version=step,
                policy_end=step + len(out) % 2,  # (not from rng: the samples stay those other tests know)
            )
        )
    return out


def contract(seq_len: int = 128, ranks: int = 1) -> OrchestratorSide:
    """The side of the run contract of an orchestrator that packs to `seq_len` for `ranks`
    data-parallel trainer ranks (with nothing else for a trainer to refuse)."""
    return OrchestratorSide("test", seq_len, ranks)


def micro_batches(step: int, run_id: str, seq_len: int = 128) -> list[MicroBatch]:
    return pack(samples(step), seq_len, 1, run_id, step, orchestrator=contract(seq_len))[0]


def test_packed_logprobs_equal_unpacked(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(0)
    seqs = [[rng.randrange(3, 500) for _ in range(n)] for n in (7, 13, 1, 9)]
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.tensor([i for s in seqs for i in range(len(s))])
    with torch.no_grad():
        packed, packed_entropy = forward_logprobs(model, ids, pos, temperature=0.7)
        start = 0
        for s in seqs:
            alone, alone_entropy = forward_logprobs(
                model, torch.tensor(s), torch.arange(len(s)), temperature=0.7
            )
            # Token 0 of each sample has no prediction inside its own sample.
            torch.testing.assert_close(packed[start + 1 : start + len(s)], alone[1:], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(
                packed_entropy[start + 1 : start + len(s)], alone_entropy[1:], rtol=1e-5, atol=1e-5
            )
            start += len(s)


def test_a_micro_batchs_logprobs_are_its_loss_tokens_only(tiny_model):
    """The trainer computes the head where a loss token is predicted: the same values there as the
    whole sequence's pass, 0 on prompt tokens (which no loss, metric or estimator reads)."""
    from prime_rl.trainer.batch import PackedBatch
    from prime_rl.trainer.logprobs import batch_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    (mb, *_) = micro_batches(3, "run", seq_len=512)
    b = PackedBatch.of(mb, World())
    with torch.no_grad():
        lp, entropy = batch_logprobs(model, b, None)
        full, full_entropy = forward_logprobs(model, b.input_ids, b.position_ids, b.temperature)
    assert 0 < int(b.loss_mask.sum()) < len(b.loss_mask)
    torch.testing.assert_close(lp[b.loss_mask], full[b.loss_mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy[b.loss_mask], full_entropy[b.loss_mask], rtol=1e-5, atol=1e-5)
    assert (lp[~b.loss_mask] == 0).all() and (entropy[~b.loss_mask] == 0).all()
    assert (full[~b.loss_mask][1:] != 0).all()  # the prompts' logprobs, which were computed before


def test_step_line_shows_the_share_of_tokens_the_clip_held_back():
    line = step_line_extras({"clipped_low/all/mean": 0.125, "clipped_high/all/mean": 0.025, "loss": 0.1})
    assert line == " | clipped 15.0%"
    assert step_line_extras({"loss": 0.1}) == ""  # a loss without a clip shows none


def test_trainer_over_zmq_trains_publishes_exports_and_resumes(tiny_model, tmp_path):
    port, out = free_port(), tmp_path / "run"
    toml = tmp_path / "trainer.toml"
    toml.write_text(
        f'output_dir = "{out}"\nmax_steps = 3\nseq_len = 128\n'
        f'[model]\nname = "{tiny_model}"\n[optim]\nlr = 1e-3\n[ckpt]\ninterval = 1\nresume_step = -1\n'
        f'[export]\nenabled = true\n[transport]\nport = {port}\nrun_id = "t"\ntimeout_s = 120\n'
    )

    def produce(steps, resend=()):
        sender = ZmqSender(f"tcp://127.0.0.1:{port}", hwm=4, timeout_s=120)
        for step in [*resend, *steps]:
            for mb in micro_batches(step, "t"):
                sender.send(mb)
        sender.close()

    producer = threading.Thread(target=produce, args=(range(3),))
    producer.start()
    proc = subprocess.run([TRAINER, "@", str(toml)], capture_output=True, text=True, timeout=300)
    producer.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "step 2 | loss" in proc.stderr
    assert "| clipped " in proc.stderr  # the default loss clips: its share is on every step line

    metrics = [json.loads(line) for line in (out / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for key in (
        "loss",
        "grad_norm",
        "lr",
        "entropy/all/mean",
        "entropy/rev/max",
        "mismatch_kl/sum/std",
        "masked_low/all/mean",
    ):
        assert key in metrics[0], key
    # Token export: one line per packed sample, READY once complete.
    tokens = out / "trainer" / "tokens" / "step_1"
    assert (tokens / "READY").exists()
    lines = [json.loads(line) for line in (tokens / "rank_0.jsonl").read_text().splitlines()]
    assert len(lines) == len(samples(1)) and {"ratio", "trainer_logprobs", "loss_mask"} <= set(lines[0])
    # Each sample says which policies sampled it (its rollout's span).
    assert sorted(tuple(line["policy"]) for line in lines) == sorted((1, s.policy_end) for s in samples(1))
    # Published weights load in transformers and differ from the start.
    for step in (1, 2, 3):
        assert (out / "weights" / f"step_{step}" / "READY").exists()
    trained = AutoModelForCausalLM.from_pretrained(out / "weights" / "step_3")
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert not torch.equal(trained.lm_head.weight, start.lm_head.weight)

    # Resume: a new trainer continues at step 3 and skips the re-sent step 2.
    toml.write_text(toml.read_text().replace("max_steps = 3", "max_steps = 5"))
    producer = threading.Thread(target=produce, args=(range(3, 5),), kwargs={"resend": (2,)})
    producer.start()
    proc = subprocess.run([TRAINER, "@", str(toml)], capture_output=True, text=True, timeout=300)
    producer.join()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from checkpoint step 3" in proc.stderr
    metrics = [json.loads(line) for line in (out / "trainer" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]


def test_killed_trainer_resumes_to_the_same_parameters(tiny_model, tmp_path):
    data = tmp_path / "data"
    sender = FileSender(data)

    def feed(steps):
        for step in steps:
            for mb in micro_batches(step, "k"):
                sender.send(mb)

    def toml(name: str, resume: bool) -> Path:
        path = tmp_path / f"{name}.toml"
        path.write_text(
            f'output_dir = "{tmp_path / name}"\nmax_steps = 4\nseq_len = 128\n[model]\nname = "{tiny_model}"\n'
            f"[optim]\nlr = 1e-3\n[ckpt]\ninterval = 2\n{'resume_step = -1' if resume else ''}\n"
            f'[transport]\ntype = "filesystem"\ndir = "{data}"\nrun_id = "k"\ntimeout_s = 120\n'
        )
        return path

    feed(range(3))  # step 3's data is not there yet: the trainer waits after step 2
    proc = subprocess.Popen(
        [TRAINER, "@", str(toml("killed", True))], stderr=subprocess.PIPE, start_new_session=True
    )
    done = tmp_path / "killed" / "checkpoints" / "step_2" / "DONE"
    deadline = time.monotonic() + 240
    while not (tmp_path / "killed" / "weights" / "step_3" / "READY").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "trainer did not reach step 3"
        time.sleep(0.2)
    assert done.exists()
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    feed([3])
    resumed = subprocess.run(
        [TRAINER, "@", str(toml("killed", True))], capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from checkpoint step 2" in resumed.stderr
    # Step 2 was trained (and logged) before the kill and again after it: logged once.
    metrics = [json.loads(line) for line in (tmp_path / "killed" / "trainer" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 3]
    straight = subprocess.run(
        [TRAINER, "@", str(toml("straight", False))], capture_output=True, text=True, timeout=300
    )
    assert straight.returncode == 0, straight.stderr[-3000:]
    a = load_file(tmp_path / "killed" / "weights" / "step_4" / "model.safetensors")
    b = load_file(tmp_path / "straight" / "weights" / "step_4" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)


def test_a_truncated_shard_in_the_newest_checkpoint_resumes_from_the_one_before(tiny_model, tmp_path):
    # Storage cut a shard of the newest checkpoint short, its DONE marker present. Resume verifies
    # it against its manifest, warns naming both checkpoints, and resumes from the one before: the
    # final parameters equal those of a run never interrupted.
    data = tmp_path / "data"
    sender = FileSender(data)
    for step in range(6):
        for mb in micro_batches(step, "t"):
            sender.send(mb)

    def trainer(name: str, max_steps: int, resume: str = "-1") -> subprocess.CompletedProcess:
        path = tmp_path / f"{name}.toml"
        path.write_text(
            f'output_dir = "{tmp_path / name}"\nmax_steps = {max_steps}\nseq_len = 128\n[model]\nname = "{tiny_model}"\n'
            f"[optim]\nlr = 1e-3\n[ckpt]\ninterval = 2\nkeep = 3\nresume_step = {resume}\n"
            f'[transport]\ntype = "filesystem"\ndir = "{data}"\nrun_id = "t"\ntimeout_s = 120\n'
        )
        return subprocess.run([TRAINER, "@", str(path)], capture_output=True, text=True, timeout=300)

    first = trainer("run", 4)
    assert first.returncode == 0, first.stderr[-3000:]
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step_4" / "MANIFEST.json").read_text())
    shard = max(manifest["files"], key=lambda f: manifest["files"][f]["size"])  # the model/optimizer shard
    path = tmp_path / "run" / "checkpoints" / "step_4" / shard
    path.write_bytes(path.read_bytes()[: manifest["files"][shard]["size"] // 2])

    explicit = trainer("run", 6, resume="4")
    assert explicit.returncode == 2 and "Traceback" not in explicit.stderr, explicit.stderr[-3000:]
    assert "trainer: error: ckpt.resume_step = 4: the checkpoint is unreadable" in explicit.stderr
    assert f"{shard} is " in explicit.stderr and "its manifest says" in explicit.stderr

    resumed = trainer("run", 6)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    warnings = [line for line in resumed.stderr.splitlines() if "unreadable" in line]
    assert len(warnings) == 1 and "checkpoint step 4 is unreadable" in warnings[0], resumed.stderr[-3000:]
    assert (
        "resuming from step 2 instead" in warnings[0] and "resumed from checkpoint step 2" in resumed.stderr
    )
    metrics = [json.loads(line) for line in (tmp_path / "run" / "trainer" / "metrics.jsonl").open()]
    assert [m["step"] for m in metrics] == list(range(6))  # steps 2, 3 trained again, logged once

    straight = trainer("straight", 6, resume="-1")
    assert straight.returncode == 0, straight.stderr[-3000:]
    a = load_file(tmp_path / "run" / "weights" / "step_6" / "model.safetensors")
    b = load_file(tmp_path / "straight" / "weights" / "step_6" / "model.safetensors")
    moved = max(
        (a[k] - load_file(tmp_path / "run" / "weights" / "step_5" / "model.safetensors")[k]).abs().max()
        for k in a
    )
    assert moved > 0
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("manifest_too", [False, True])
def test_a_checkpoint_another_process_changed_resumes_from_the_one_before(
    tiny_model, tmp_path, monkeypatch, caplog, manifest_too
):
    # With a run secret, someone who can write checkpoints/ changes the newest checkpoint's shard
    # (and, `manifest_too`, writes it a fresh manifest, CRC-32s and all, as our own code does without
    # a secret). Resume (the path `trainer`, `sft` and `train-reward-model` take) refuses it as
    # damaged, warns naming the file that does not match, and loads the checkpoint before it.
    def use_secret(value):
        monkeypatch.delenv(secret.FILE_ENV, raising=False)
        if value:
            monkeypatch.setenv(secret.ENV, value)
        else:
            monkeypatch.delenv(secret.ENV)
        secret.value.cache_clear()

    use_secret("run-secret")
    try:
        world = World()
        config = TrainerConfig(
            model={"name": str(tiny_model)}, seq_len=128, output_dir=tmp_path, ckpt={"resume_step": -1}
        )
        trainer = Trainer(config, world)
        checkpointer = Checkpointer(
            checkpoint_root(tmp_path), world, 3, trainer.model, trainer.optimizer, trainer.scheduler
        )
        checkpointer.save(2)
        at_2 = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        with torch.no_grad():
            for p in trainer.model.parameters():
                p.add_(1.0)
        newest = checkpointer.save(4)
        files = json.loads((newest / "MANIFEST.json").read_text())["files"]
        shard = newest / max(files, key=lambda f: files[f]["size"])
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        if manifest_too:
            use_secret(None)
            write_manifest(newest)
            use_secret("run-secret")

        with caplog.at_level(logging.WARNING, logger="prime_rl"):
            assert resume(config, world, checkpointer)[0] == 2
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        named = (
            f"{newest / 'MANIFEST.json'} is not keyed by the run secret"
            if manifest_too
            else f"{shard} does not"
        )
        assert len(warnings) == 1 and warnings[0].startswith(f"checkpoint step 4 is unreadable ({named}"), (
            warnings
        )
        assert warnings[0].endswith("resuming from step 2 instead")
        for key, value in trainer.model.state_dict().items():
            torch.testing.assert_close(value, at_2[key], rtol=0, atol=0, msg=key)
    finally:
        secret.value.cache_clear()


def test_a_step_with_no_samples_says_so_and_leaves_the_parameters_alone(tiny_model, tmp_path):
    # Step 1's groups were all filtered: the orchestrator sends only masked filler.
    data = tmp_path / "data"
    sender = FileSender(data)
    for step in range(3):
        for mb in (
            micro_batches(step, "e") if step != 1 else pack([], 128, 1, "e", 1, orchestrator=contract())[0]
        ):
            sender.send(mb)
    toml = tmp_path / "t.toml"
    toml.write_text(
        f'output_dir = "{tmp_path / "out"}"\nmax_steps = 3\nseq_len = 128\n[model]\nname = "{tiny_model}"\n'
        f"[optim]\nlr = 1e-3\n[publish]\nkeep = 4\n"
        f'[transport]\ntype = "filesystem"\ndir = "{data}"\nrun_id = "e"\ntimeout_s = 120\n'
    )
    proc = subprocess.run([TRAINER, "@", str(toml)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if " step " in line]
    assert "step 1 | no samples" in lines[1] and not any("nan" in line for line in lines), lines
    records = [json.loads(line) for line in (tmp_path / "out" / "trainer" / "metrics.jsonl").open()]
    assert records[1]["loss_tokens"] == 0 and None not in records[1].values(), records[1]
    weights = {
        s: load_file(tmp_path / "out" / "weights" / f"step_{s}" / "model.safetensors") for s in (1, 2, 3)
    }
    assert all(torch.equal(weights[1][k], weights[2][k]) for k in weights[1])  # step 1 changed nothing
    assert any(not torch.equal(weights[2][k], weights[3][k]) for k in weights[2])  # step 2 trained


def test_inconsistent_and_overlong_micro_batches_are_rejected(tmp_path):
    sender = FileSender(tmp_path)
    good = micro_batches(0, "b")[0]
    fields = {f: getattr(good, f) for f in good.__struct_fields__}
    sender.send(MicroBatch(**{**fields, "logprobs": good.logprobs[:-4]}))
    side = TrainerSide(seq_len=128, dp=1)
    with pytest.raises(BadMicroBatch, match="per-token fields disagree"):
        StepReceiver(FileReceiver(tmp_path, "b", timeout_s=2), seq_len=128, side=side).get(0)
    with pytest.raises(BadMicroBatch, match="longer than seq_len = 8"):
        sender.send(good)  # (its contract promises seq_len 128: the receiver's own limit is the check)
        StepReceiver(FileReceiver(tmp_path, "b", timeout_s=2), seq_len=8, side=side).get(0)


def test_model_folder_that_does_not_load_is_a_clear_error(tmp_path):
    # (A missing folder is already a config error: see bad_input_test.py.)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no-such-architecture"}')
    config = TrainerConfig(model={"name": str(broken)}, output_dir=str(tmp_path))
    with pytest.raises(ModelLoadError, match="could not be loaded"):
        train(config)
    proc = subprocess.run([TRAINER, "--model.name", str(broken), "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert (
        proc.returncode == 2
        and "trainer: error: trainer.model.name" in proc.stderr
        and "Traceback" not in proc.stderr
    )


def nan_loss(inputs):
    from prime_rl.trainer.losses import LossOutputs

    return LossOutputs(inputs.trainer_logprobs * float("nan"))


def nan_gradient(inputs):
    """Finite (0) on every token, with a NaN gradient: d sqrt(|x|)/dx at 0 is inf * sign(0)."""
    from prime_rl.trainer.losses import LossOutputs

    return LossOutputs((inputs.trainer_logprobs - inputs.trainer_logprobs.detach()).abs().sqrt())


@pytest.mark.parametrize("bad", [nan_loss, nan_gradient])
def test_nan_loss_skips_the_step_and_stops_after_n(tiny_model, tmp_path, bad):
    data = tmp_path / "data"
    sender = FileSender(data)
    for step in range(4):
        for mb in micro_batches(step, "n"):
            sender.send(mb)
    config = TrainerConfig(
        model={"name": str(tiny_model)}, output_dir=str(tmp_path / "out"), max_steps=4, seq_len=128, max_nan_steps=2,
        transport={"type": "filesystem", "dir": str(data), "run_id": "n", "timeout_s": 30},
    )  # fmt: skip
    with pytest.raises(NaNLossError, match="2 consecutive steps"):
        train(config, loss_fn=bad)
    start = load_file(Path(tiny_model) / "model.safetensors")
    after = load_file(tmp_path / "out" / "weights" / "step_1" / "model.safetensors")
    assert all(torch.equal(start[k], after[k]) for k in start)  # the NaN step did not update


def test_a_step_that_runs_out_of_memory_names_the_knobs(tiny_model, tmp_path):
    data = tmp_path / "data"
    sender = FileSender(data)
    for mb in micro_batches(0, "m"):
        sender.send(mb)
    config = TrainerConfig(
        model={"name": str(tiny_model)}, output_dir=str(tmp_path / "out"), max_steps=1, seq_len=128,
        transport={"type": "filesystem", "dir": str(data), "run_id": "m", "timeout_s": 30},
    )  # fmt: skip

    def greedy_loss(inputs):
        torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: the CPU allocator refuses
        raise AssertionError("allocated 1 PiB")

    with pytest.raises(OutOfMemory) as error:
        train(config, loss_fn=greedy_loss)
    message = str(error.value)
    assert message.startswith("step 0 ran out of CPU memory on micro-batches of up to ")
    assert "can't allocate memory" in message and "\n" not in message
    assert "trainer.model.activation_checkpointing = true; " in message
    assert "seq_len = 64 (the micro-batch token budget; now 128)" in message
    assert 'trainer.model.dtype = "bfloat16"' in message
    with_ac = config.model_copy(
        update={"model": config.model.model_copy(update={"activation_checkpointing": True})}
    )
    assert "activation_checkpointing" not in "; ".join(advice(with_ac, ranks=1))
    assert "trainer.parallel.cp = 2 (tokens per rank / 2)" in advice(config, ranks=2)


def test_header_must_match_the_run(tmp_path):
    from prime_rl.transport.base import ForeignRunError

    sender = FileSender(tmp_path)
    mb = micro_batches(0, "other")[0]
    sender.send(
        MicroBatch(**{**{f: getattr(mb, f) for f in mb.__struct_fields__}, "header": Header("other", 0, 0)})
    )
    with pytest.raises(ForeignRunError):
        StepReceiver(FileReceiver(tmp_path, "mine", timeout_s=2), 128, TrainerSide(128, 1)).get(0)


def test_two_ranks_train_checkpoint_publish_and_resume(tiny_model, tmp_path):
    data, out = tmp_path / "data", tmp_path / "out"
    sender = FileSender(data)

    def feed(steps):
        for step in steps:
            for rank_mbs in pack(samples(step, n=12), 128, 2, "two", step, orchestrator=contract(ranks=2)):
                for mb in rank_mbs:
                    sender.send(mb)

    toml = tmp_path / "t.toml"
    toml.write_text(
        f'output_dir = "{out}"\nmax_steps = 2\nseq_len = 128\n[model]\nname = "{tiny_model}"\n'
        f"[ckpt]\ninterval = 2\nresume_step = -1\n[export]\nenabled = true\n"
        f'[transport]\ntype = "filesystem"\ndir = "{data}"\nrun_id = "two"\ntimeout_s = 60\n'
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "prime_rl.trainer.main", "@", str(toml)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    feed(range(2))
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert (out / "checkpoints" / "step_2" / "DONE").exists()
    assert sorted(p.name for p in (out / "trainer" / "tokens" / "step_1").iterdir()) == [
        "READY", "rank_0.jsonl", "rank_1.jsonl"
    ]  # fmt: skip
    feed([2])
    toml.write_text(toml.read_text().replace("max_steps = 2", "max_steps = 3"))
    cmd[cmd.index("--master-port") + 1] = str(free_port())
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from checkpoint step 2" in second.stderr
    published = AutoModelForCausalLM.from_pretrained(out / "weights" / "step_3")
    assert published.config.vocab_size == AutoModelForCausalLM.from_pretrained(tiny_model).config.vocab_size


def test_token_stats_match_a_hand_computation():
    from prime_rl.trainer.parallel.dist import World
    from prime_rl.trainer.rl.trainer import TokenStats

    stats = TokenStats()
    rows = stats.rows(["a", "b", "a"])  # three samples
    per_token = rows[torch.tensor([0, 0, 1, 2, 2, 2, 2])]  # the last token is masked out
    stats.add(
        "x",
        per_token,
        torch.tensor([1.0, 3.0, 10.0, 2.0, 2.0, 8.0, 99.0]),
        torch.tensor([True] * 6 + [False]),
    )
    stats.add(
        "y", stats.rows(["c"])[torch.tensor([0])], torch.tensor([-1.0]), torch.tensor([True])
    )  # a new env later
    out = stats.reduce(World(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    a = [1.0, 3.0, 2.0, 2.0, 8.0]
    mean = sum(a) / 5
    assert math.isclose(out["x/a/mean"], mean) and out["x/a/max"] == 8.0 and out["x/b/mean"] == 10.0
    assert math.isclose(out["x/a/std"], math.sqrt(sum((v - mean) ** 2 for v in a) / 5))
    assert math.isclose(out["x/all/mean"], 26.0 / 6) and out["x/all/max"] == 10.0
    assert out["y/c/mean"] == -1.0 and out["y/all/max"] == -1.0 and "y/a/mean" not in out


def test_a_micro_batch_may_outgrow_the_model_context_but_not_a_sample(tiny_model, tmp_path):
    """seq_len (the packed micro-batch) is not bounded by the model's positions, since packed
    samples restart theirs; a single sample longer than the context is one line naming both."""
    import shutil

    from prime_rl.trainer.data import SampleTooLong
    from prime_rl.trainer.parallel.dist import init_world
    from prime_rl.trainer.rl.trainer import Trainer

    folder = tmp_path / "short"
    shutil.copytree(tiny_model, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    trainer = Trainer(
        TrainerConfig(model={"name": str(folder)}, seq_len=256, output_dir=str(tmp_path)), init_world()
    )
    fits = pack(samples(0, n=12), 256, 1, "c", 0)[0]  # samples of at most 50 tokens
    assert max(mb.num_tokens for mb in fits) > 64
    metrics, _ = trainer.train_step(fits, 0)
    assert math.isfinite(metrics["loss"]) and metrics["loss_tokens"] > 0
    long = TrainingSample(
        [5] * 30, [6] * 40, [1] * 40, [-6.0] * 40, advantage=1.0, reward=0.0, env_name="rev"
    )
    with pytest.raises(
        SampleTooLong, match=r"env 'rev' .* has 70 tokens, more than the 64 positions of trainer.model.name"
    ):
        trainer.train_step(pack([long], 256, 1, "c", 1)[0], 1)


KEEP_FREED = """
import sys, torch
from prime_rl.trainer.memory import keep_freed_memory
from prime_rl.trainer.parallel.dist import World

def rss_mb():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) / 1024

if sys.argv[1] == "keep":
    assert keep_freed_memory(World())
x = torch.ones(64 * 2**20 // 4)  # 64 MB, above glibc's largest mmap threshold
before = rss_mb()
del x
print(before - rss_mb())
"""


@pytest.mark.parametrize("mode", ["default", "keep"])
def test_a_cpu_trainer_keeps_freed_activations_in_its_heap(mode):
    """glibc unmaps a freed 64 MB block (the next step would fault its pages in again); after
    keep_freed_memory, the trainer's heap keeps it for the next step."""
    out = subprocess.run(
        [sys.executable, "-c", KEEP_FREED, mode], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    returned = float(out.stdout.split()[-1])
    assert (returned > 48) if mode == "default" else (returned < 16), returned
