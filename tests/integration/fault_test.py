"""Fault tests with the real processes: real vLLM, trainer and orchestrator, killed with SIGKILL.

- The trainer killed at a random step under `rl`: rerunning the command resumes it from its last
  checkpoint, the orchestrator re-sends the saved batches from there, and the final parameters equal
  those of a trainer that was never interrupted, fed the same batches.
- Run as three separate processes: the inference server is killed and restarted, then the
  orchestrator is killed and restarted, while the trainer keeps running: it trains every step
  exactly once, the restarted server is put back on the current weights before it serves, and the
  orchestrator resumes at the step after the last one it saved.
- Chaos under `rl` with `deployment.max_restarts`: six SIGKILLs of random processes at random
  moments; `rl` restarts each, and the run finishes with every step trained once.
- A full disk under `rl`: one line naming the path, no traceback; after space is freed, the same
  command resumes.
"""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
import torch
from rl_test import write_config
from safetensors.torch import load_file

from helpers.cores import server_env
from helpers.run_secret import holding
from prime_rl.config import parse_config
from prime_rl.config.cli import to_toml
from prime_rl.engine.server import wait_until_healthy
from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.machine import here
from prime_rl.launcher.plan import plan
from prime_rl.orchestrator.loop.progress import load_batch
from prime_rl.runtime import secret
from prime_rl.runtime.layout import checkpoint_root, complete_steps
from prime_rl.runtime.monitor import read_metrics
from prime_rl.transport.contract import OrchestratorSide
from prime_rl.transport.file_transport import FileSender
from prime_rl.transport.packing import pack
from small_disk import small_disk

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def jsonl(path: Path) -> list[dict]:
    return read_metrics(path) if path.exists() else []  # a line still being written is left out


def wait_until(condition, what: str, procs=(), timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        for p in procs:
            assert p.poll() is None, f"{p.args[0]} exited with {p.returncode} while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    assert out, f"no weights in {folder}"
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def replay(run: Path, out: Path, steps: int, seq_len: int) -> Path:
    """Train a fresh trainer, never interrupted, on the batches the run saved; return its weights dir."""
    transport = out / "transport"
    sender = FileSender(transport)
    with holding(run / secret.FILE_NAME):  # the run's saved batches, sealed with its secret; so are these
        for step in range(steps):
            batch = load_batch(run, step)
            assert batch is not None, f"the run did not save the batch of step {step}"
            for mb in pack(
                batch.samples, seq_len, 1, "replay", step, orchestrator=OrchestratorSide("replay", seq_len, 1)
            )[0]:
                sender.send(mb)
    cmd = [str(BIN / "trainer"), "@", str(run / "configs" / "trainer.toml"), "--output_dir", str(out),
           "--transport.type", "filesystem", "--transport.dir", str(transport), "--transport.run_id", "replay"]  # fmt: skip
    # As `rl` runs the trainer on 2 cores; with the run's secret, whose seals the data carries.
    env = {**os.environ, "OMP_NUM_THREADS": "1", secret.FILE_ENV: str(run / secret.FILE_NAME)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out / "weights" / f"step_{steps}"


def test_trainer_killed_at_a_random_step_resumes_to_the_same_parameters(tiny_model, tmp_path):
    seed = int(os.environ.get("PRIME_RL_FAULT_SEED", time.time_ns() % 10_000))
    kill_after = random.Random(seed).randint(2, 5)  # trainer steps done when it is killed
    why = f"(seed {seed}: PRIME_RL_FAULT_SEED={seed} repeats it; killed after {kill_after} steps)"
    toml = write_config(tmp_path, tiny_model, "reverse-text", steps=6, extra="[trainer.ckpt]\ninterval = 2\n")
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [BIN / "rl", "@", toml], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    wait_until(lambda: len(jsonl(run / "trainer" / "metrics.jsonl")) >= kill_after, "trainer steps", [proc])
    trainer_pid = next(
        c.info["pid"]
        for c in psutil.process_iter(["pid", "ppid", "cmdline"])
        if c.info["ppid"] == proc.pid and any(a.endswith("/trainer") for a in (c.info["cmdline"] or [])[:2])
    )
    os.kill(trainer_pid, signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "trainer exited with status -9" in err, out + err
    # The kill can land anywhere in a step, e.g. after step N's metrics line but before checkpoint
    # N (its commit point): the contract is a resume from the last checkpoint complete at the kill.
    # Checkpoint N is written after step N-1's metrics line, so the lines seen guarantee this one.
    complete = complete_steps(checkpoint_root(run))
    assert (complete[-1:] or [0])[0] >= (kill_after - 1) // 2 * 2, (complete, why)

    again = subprocess.run([BIN / "rl", "@", toml], capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    log = (run / "logs" / "trainer.log").read_text()
    resumed = [
        int(line.rsplit(" ", 1)[1]) for line in log.splitlines() if "resumed from checkpoint step" in line
    ]
    assert resumed == complete[-1:], (resumed, complete, why)
    # One record per step in each process's metrics, however the kill fell: the trainer's steps
    # after its checkpoint were trained again, and the orchestrator's step being sent when the
    # trainer died was committed (so it was re-sent, not rebuilt).
    assert [m["step"] for m in jsonl(run / "trainer" / "metrics.jsonl")] == list(range(6)), why
    orch = jsonl(run / "orchestrator" / "metrics.jsonl")
    assert [m["step"] for m in orch] == list(range(6)), why
    last = orch[-1]
    pending = last["rollouts/all/inflight"] + last["rollouts/all/waiting"]
    buckets = sum(last[f"rollouts/all/{b}_total"] for b in ("trained", "filtered", "failed", "stale"))
    assert last["rollouts/all/dispatched_total"] == buckets + pending

    # Same batches, never interrupted: the same parameters, up to float noise.
    resumed_w = weights(run / "weights" / "step_6")
    replay_w = weights(replay(run, tmp_path / "replay", 6, seq_len=256))
    diff = max_diff(resumed_w, replay_w)
    moved = max_diff(resumed_w, weights(run / "weights" / "step_5"))  # one step's update, for scale
    assert diff <= 1e-6 + 1e-3 * moved, (diff, moved, why)


def start(name: str, cmd: list, log_dir: Path) -> subprocess.Popen:
    log = (log_dir / f"{name}.log").open("a")
    env = {**server_env(), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)  # fmt: skip


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the whole process group (vLLM's engine core too) and wait until every member is gone:
    a child that outlives its parent holds the parent's listening port."""
    group = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _, alive = psutil.wait_procs(group, timeout=60)
    assert not alive, alive


def test_inference_then_orchestrator_killed_and_restarted_while_the_trainer_runs(tiny_model, tmp_path):
    steps = 8
    toml = write_config(tmp_path, tiny_model, "reverse-text", steps=steps)
    # Synchronous, so the sampler's and the trainer's logprobs agree unless the weights differ.
    cfg = parse_config(RLConfig, ["@", str(toml), "--max-async-level", "0"])
    paths = {}
    wired = plan(cfg, here(cfg))
    for name in ("inference", "orchestrator", "trainer"):
        paths[name] = tmp_path / f"{name}.toml"
        paths[name].write_text(to_toml(getattr(wired, name)))
    run, logs = tmp_path / "run", tmp_path
    url = f"http://127.0.0.1:{cfg.inference.server.port}"
    procs = {}
    procs["inference"] = start("inference", [BIN / "inference", "@", paths["inference"]], logs)
    try:
        wait_until_healthy(url, timeout_s=300, process=procs["inference"])
        procs["trainer"] = start("trainer", [BIN / "trainer", "@", paths["trainer"]], logs)
        procs["orchestrator"] = start(
            "orchestrator", [BIN / "orchestrator", "@", paths["orchestrator"]], logs
        )
        orch_metrics = run / "orchestrator" / "metrics.jsonl"

        # 1. Inference dies mid-run (rollouts in flight fail) and comes back from the base model.
        wait_until(lambda: len(jsonl(orch_metrics)) >= 2, "2 orchestrator steps", procs.values())
        kill(procs["inference"])
        procs["inference"] = start("inference", [BIN / "inference", "@", paths["inference"]], logs)
        wait_until_healthy(url, timeout_s=300, process=procs["inference"])
        orch_log = logs / "orchestrator.log"
        wait_until(
            lambda: "is back after" in orch_log.read_text(), "the orchestrator to resync", procs.values()
        )

        # 2. The orchestrator dies mid-run; the trainer keeps waiting for data meanwhile.
        wait_until(lambda: len(jsonl(orch_metrics)) >= 5, "5 orchestrator steps", procs.values())
        kill(procs["orchestrator"])
        saved = json.loads((run / "orchestrator" / "progress.json").read_text())["step"]
        procs["orchestrator"] = start(
            "orchestrator", [BIN / "orchestrator", "@", paths["orchestrator"]], logs
        )
        for name in ("orchestrator", "trainer"):
            assert procs[name].wait(timeout=600) == 0, (logs / f"{name}.log").read_text()[-3000:]
        with urllib.request.urlopen(f"{url}/prime_rl/weights", timeout=10) as reply:
            served = json.loads(reply.read())
    finally:
        for p in procs.values():
            if p.poll() is None:
                kill(p)

    text = orch_log.read_text()
    assert "is back after" in text and f"resuming at step {saved}" in text
    trainer = jsonl(run / "trainer" / "metrics.jsonl")
    assert [m["step"] for m in trainer] == list(range(steps))  # never restarted: each step once
    # Rollouts from the restarted server were sampled with the weights they are tagged with: a
    # server left on the base model would show up as a large sampler/trainer mismatch (one step
    # of this lr moves the policy by a KL of ~1e-2).
    assert max(m["mismatch_kl/all/mean"] for m in trainer) < 1e-3, [
        m["mismatch_kl/all/mean"] for m in trainer
    ]
    orch = jsonl(orch_metrics)
    assert [m["step"] for m in orch] == list(range(steps))  # a step logged but not saved: dropped
    last = orch[-1]
    pending = last["rollouts/all/inflight"] + last["rollouts/all/waiting"]
    buckets = sum(last[f"rollouts/all/{b}_total"] for b in ("trained", "filtered", "failed", "stale"))
    assert last["rollouts/all/dispatched_total"] == buckets + pending
    assert served["step"] == orch[-1]["policy_version"]


def run_children(rl: subprocess.Popen) -> dict[str, int]:
    """The process of each kind `rl` started (inference, trainer, orchestrator) -> its pid."""
    out = {}
    for c in psutil.Process(rl.pid).children():
        with contextlib.suppress(psutil.Error):
            cmdline = c.cmdline()  # [python, .../bin/<script>, ...] or [python, -m, <module>, ...]
            names = [Path(a).name for a in cmdline[:2]]
            for kind in ("inference", "trainer", "orchestrator"):
                if kind in names:
                    out[kind] = c.pid
            if "prime_rl.trainer.parallel.torchrun" in cmdline:
                out["trainer"] = c.pid
            if "prime_rl.inference.vllm_server" in cmdline:
                out["inference"] = c.pid
    return out


def max_step(path: Path) -> int:
    return max((m["step"] for m in jsonl(path)), default=-1)


def test_max_restarts_survives_random_kills_of_every_process(tiny_model, tmp_path):
    """Chaos: SIGKILL a random process of the run (its whole process group) at random moments, 6
    times, each kind at least twice. `rl` restarts each one and the run finishes: every step trained
    once, each process's metrics one record per step, the accounting adds up, the restarts counted."""
    seed = int(os.environ.get("PRIME_RL_FAULT_SEED", time.time_ns() % 10_000))
    rng = random.Random(seed)
    kinds = ["inference", "trainer", "orchestrator"] * 2
    rng.shuffle(kinds)
    why = f"(seed {seed}: PRIME_RL_FAULT_SEED={seed} repeats it; kills {kinds})"
    steps = 26  # each kill takes 1-3 steps (progress since the restart, then up to 1 s; measured: the
    # six were done by step 10): ample for 6, and the test fails loudly (`kind in pids`) rather than
    # passing short if the run ever ends first. Every step after the last kill is only waited for.
    toml = write_config(tmp_path, tiny_model, "reverse-text", steps=steps, extra=(
        "[trainer.ckpt]\ninterval = 2\n[deployment]\nmax_restarts = 4\nrestart_backoff_s = 0.5\n"
    ))  # fmt: skip
    run = tmp_path / "run"
    trainer_m, orch_m = run / "trainer" / "metrics.jsonl", run / "orchestrator" / "metrics.jsonl"
    out_path, err_path = tmp_path / "rl.out", tmp_path / "rl.err"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen([BIN / "rl", "@", toml], stdout=out, stderr=err, text=True)
    try:
        for i, kind in enumerate(kinds):
            # A moment at random: after the run made progress since the last restart, plus up to 1 s.
            wait_until(lambda: max_step(trainer_m) >= 1 and max_step(orch_m) >= 1, "first steps", [proc])
            time.sleep(rng.uniform(0.0, 1.0))
            pids = run_children(proc)
            assert kind in pids, (kind, pids, why)
            at = (max_step(trainer_m), max_step(orch_m))
            os.killpg(pids[kind], signal.SIGKILL)
            killed = sum(k == kind for k in kinds[: i + 1])
            wait_until(
                lambda kind=kind, n=killed: restarted(run, kind) >= n,
                f"rl to restart the {kind}",
                [proc],
                120,
            )
            # Progress after the restart, in both processes, before the next kill.
            wait_until(lambda at=at: max_step(trainer_m) > at[0] and max_step(orch_m) > at[1],
                       f"progress after the {kind} restart {why}", [proc])  # fmt: skip
        assert proc.wait(timeout=900) == 0, err_path.read_text()[-3000:] + why
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    console = err_path.read_text()
    records = restart_records(run)
    # Each kill was restarted; a kill may also make another process fail and be restarted (e.g. the
    # orchestrator giving up on a weight reload while the server is down): counted the same way.
    assert all(restarted(run, k) >= kinds.count(k) for k in set(kinds)), (records, why)
    assert console.count("restarting it") == len(records), console[-3000:]
    assert "rl: done" in out_path.read_text()
    assert [m["step"] for m in jsonl(trainer_m)] == list(range(steps)), why
    orch = jsonl(orch_m)
    assert [m["step"] for m in orch] == list(range(steps)), why
    last = orch[-1]
    pending = last["rollouts/all/inflight"] + last["rollouts/all/waiting"]
    buckets = sum(last[f"rollouts/all/{b}_total"] for b in ("trained", "filtered", "failed", "stale"))
    assert last["rollouts/all/dispatched_total"] == buckets + pending, why
    assert sum(v for k, v in last.items() if k.startswith("restarts/")) == len(records), (last, why)
    # Every step's batch trained once: the trainer's token counts per step match the batches the
    # orchestrator logged for those steps (a step trained on two batches, or none, would not).
    trainer = jsonl(trainer_m)
    assert all(t["tokens"] == o["batch/tokens"] for t, o in zip(trainer, orch, strict=True)), why


def restart_records(run: Path) -> list[dict]:
    path = run / "restarts.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]  # whole lines


def restarted(run: Path, kind: str) -> int:
    return sum(r["process"] == kind for r in restart_records(run))


def test_a_full_disk_under_rl_is_one_line_and_rerunning_after_freeing_space_resumes(tiny_model, tmp_path):
    disk = tmp_path / "disk"
    with small_disk(disk, "12M") as grow:  # fills during the first checkpoint
        toml = write_config(disk, tiny_model, "reverse-text", steps=4, extra="[trainer.ckpt]\ninterval = 2\n")
        full = subprocess.run([BIN / "rl", "@", toml], capture_output=True, text=True, timeout=900)
        console = full.stdout + full.stderr
        assert full.returncode == 2, console[-3000:]
        assert "Traceback" not in console and "OSError" not in console, console[-3000:]
        errors = [
            line for line in console.splitlines() if ": error: no space left on the disk holding" in line
        ]
        assert errors and all(str(disk / "run") in line and "while writing" in line for line in errors), (
            console
        )
        assert "exited with status 2; stopping the others" in console

        grow("512M")
        again = subprocess.run([BIN / "rl", "@", toml], capture_output=True, text=True, timeout=900)
        assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
        assert [m["step"] for m in jsonl(disk / "run" / "trainer" / "metrics.jsonl")] == list(range(4))
        orch = jsonl(disk / "run" / "orchestrator" / "metrics.jsonl")
        assert [m["step"] for m in orch] == list(range(4))
