"""A full disk under the trainer and under the orchestrator: one line naming the path and what was
being written, exit status 2, no traceback; once space is freed, the same command resumes and the
run ends as if the disk had never filled. The disk is a small tmpfs mounted by the test (root only:
skipped, saying why, where it cannot be mounted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from trainer_test import micro_batches

from fake_server import MODEL, FakeServer
from prime_rl.runtime.monitor import read_metrics
from prime_rl.transport.file_transport import FileSender
from small_disk import small_disk

BIN = Path(sys.executable).parent


def assert_one_line(out: subprocess.CompletedProcess, prog: str, *phrases: str) -> str:
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if line.startswith(f"{prog}: error:")]
    assert len(lines) == 1, out.stderr[-3000:]
    for phrase in phrases:
        assert phrase in lines[0], (phrase, lines[0])
    return lines[0]


def test_the_trainer_on_a_full_disk_stops_with_one_line_and_resumes_once_space_is_freed(tiny_model, tmp_path):
    data = tmp_path / "data"
    sender = FileSender(data)
    for step in range(6):
        for mb in micro_batches(step, "d"):
            sender.send(mb)

    def trainer(out: Path) -> subprocess.CompletedProcess:
        toml = tmp_path / f"{out.name}.toml"
        toml.write_text(
            f'output_dir = "{out}"\nmax_steps = 6\nseq_len = 128\n[model]\nname = "{tiny_model}"\n'
            f"[optim]\nlr = 1e-3\n[ckpt]\ninterval = 2\nresume_step = -1\n[publish]\nkeep = 1\n"
            f'[transport]\ntype = "filesystem"\ndir = "{data}"\nrun_id = "d"\ntimeout_s = 120\n'
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return subprocess.run([str(BIN / "trainer"), "@", str(toml)], capture_output=True, text=True,
                              timeout=300, env=env)  # fmt: skip

    disk = tmp_path / "disk"
    with small_disk(disk, "12M") as grow:  # the weights (2 MB a step) fit; the first checkpoint does not
        full = trainer(disk / "run")
        line = assert_one_line(full, "trainer", "no space left on the disk holding", str(disk / "run"),
                               "while writing", "run the same command again")  # fmt: skip
        assert "checkpoint" in line or "weights" in line or "metrics" in line, line
        grow("256M")
        resumed = trainer(disk / "run")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        metrics = read_metrics(disk / "run" / "trainer" / "metrics.jsonl")
        assert [m["step"] for m in metrics] == list(range(6))
        a = load_file(disk / "run" / "weights" / "step_6" / "model.safetensors")
    straight = trainer(tmp_path / "straight")
    assert straight.returncode == 0, straight.stderr[-3000:]
    b = load_file(tmp_path / "straight" / "weights" / "step_6" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=key)


def test_the_orchestrator_on_a_full_disk_stops_with_one_line_and_resumes_once_space_is_freed(tmp_path):
    def orchestrator(out: Path, server: FakeServer) -> subprocess.CompletedProcess:
        args = ["--model.name", MODEL, "--output-dir", str(out), "--max-steps", "6", "--batch-size", "16", "--seq-len", "256",
                "--max-async-level", "10", "--envs", '[{id = "reverse-text", group_size = 4}]',
                "--client.base-urls", f'["{server.base_url}"]', "--transport.type", "filesystem",
                "--transport.run-id", "d", "--resume", "true", "--filters", "[]"]  # fmt: skip
        return subprocess.run([str(BIN / "orchestrator"), *args], capture_output=True, text=True, timeout=300)

    disk = tmp_path / "disk"
    with FakeServer() as server, small_disk(disk, "256k") as grow:  # a few steps' rollouts and batches
        full = orchestrator(disk / "run", server)
        assert_one_line(full, "orchestrator", "no space left on the disk holding", str(disk / "run"),
                        "while writing", "run the same command again")  # fmt: skip
        grow("64M")
        resumed = orchestrator(disk / "run", server)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        metrics = read_metrics(disk / "run" / "orchestrator" / "metrics.jsonl")
        assert [m["step"] for m in metrics] == list(range(6))  # each step once, none lost
        last = metrics[-1]
        buckets = sum(last[f"rollouts/all/{b}_total"] for b in ("trained", "filtered", "failed", "stale"))
        assert (
            last["rollouts/all/dispatched_total"]
            == buckets + last["rollouts/all/inflight"] + last["rollouts/all/waiting"]
        )
        steps = sorted(
            json.loads(p.read_text().splitlines()[0])["step"]
            for p in (disk / "run" / "rollouts").glob("*.jsonl")
        )
        assert steps == list(range(6))
