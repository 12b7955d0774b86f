"""Beyond one machine, on loopback: several trainer nodes, several inference servers.

- `rl` started once per "node" of a multi-node deployment: two trainer nodes of one rank each (two
  torchrun agents meeting at a c10d rendezvous) train the same global batches as one node of two
  ranks: the same gradients (norm per step) and parameters after every step. The data comes through
  the filesystem transport, as an orchestrator would send it.
- `rl` with two real vLLM servers, one killed mid-run: the run completes on the other, every step
  is trained once, and every dispatched rollout is accounted for.
"""

import hashlib
import hmac
import json
import os
import signal
import subprocess
import sys
import threading
import tomllib
from datetime import timedelta
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from fault_test import jsonl, wait_until
from rl_test import write_config
from safetensors.torch import load_file

from helpers.grad_worker import make_samples
from helpers.run_secret import holding
from prime_rl.auth.clients import Signed
from prime_rl.runtime import secret
from prime_rl.runtime.monitor import read_metrics
from prime_rl.runtime.net import free_port
from prime_rl.transport.contract import OrchestratorSide
from prime_rl.transport.file_transport import FileSender
from prime_rl.transport.packing import pack

pytestmark = pytest.mark.slow

RL = str(Path(sys.executable).parent / "rl")
STEPS, WORLD, SEQ_LEN, RUN_ID = 3, 2, 128, "multinode"


def deployment(trainer_nodes: int, ranks: int) -> str:
    nodes = '[[deployment.nodes]]\nhost = "127.0.0.1"\nroles = ["inference", "orchestrator"]\n'
    nodes += '[[deployment.nodes]]\nhost = "127.0.0.1"\nroles = ["trainer"]\n' * trainer_nodes
    return f"[deployment]\ntrainer_ranks = {ranks}\nrendezvous_port = {free_port()}\ntrainer_cpus = [0, 1]\n{nodes}"


def write_run(tmp_path: Path, name: str, model: Path, trainer_nodes: int, ranks: int) -> tuple[Path, Path]:
    run, data = tmp_path / name, tmp_path / f"{name}-data"
    sender = FileSender(data)
    # Written as the run's orchestrator would: sealed with the run's secret (`rl` keeps that file).
    with holding(secret.create(run)):
        for step in range(STEPS):
            side = OrchestratorSide("test", SEQ_LEN, WORLD)
            for rank_mbs in pack(
                make_samples(12, seed=step), SEQ_LEN, WORLD, RUN_ID, step, orchestrator=side
            ):
                for mb in rank_mbs:
                    sender.send(mb)
    toml = tmp_path / f"{name}.toml"
    toml.write_text(
        f'model = "{model}"\noutput_dir = "{run}"\nmax_steps = {STEPS}\nseq_len = {SEQ_LEN}\n'
        "[trainer.loss]\nclip_low = 1e9\nclip_high = 1e9\nmask_low = 0.0\nmask_high = 1e30\n"
        f'[orchestrator.transport]\ntype = "filesystem"\ndir = "{data}"\nrun_id = "{RUN_ID}"\ntimeout_s = 120\n'
        + deployment(trainer_nodes, ranks)
    )
    return toml, run


def start_node(toml: Path, node: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with log.open("w") as out:
        return subprocess.Popen([RL, "@", str(toml), "--deployment.node", str(node)], stdout=out,
                                stderr=subprocess.STDOUT, env=env)  # fmt: skip


def finish(proc: subprocess.Popen, log: Path) -> None:
    try:
        code = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0, log.read_text()[-4000:]


def trained(run: Path) -> tuple[list[float], dict[str, torch.Tensor]]:
    metrics = read_metrics(run / "trainer" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(STEPS))
    weights = load_file(next((run / "weights" / f"step_{STEPS}").glob("*.safetensors")))
    return [m["grad_norm"] for m in metrics], weights


def test_two_trainer_nodes_of_one_rank_train_like_one_node_of_two(tiny_model, tmp_path):
    toml, one_node = write_run(tmp_path, "one-node", tiny_model, trainer_nodes=1, ranks=2)
    finish(start_node(toml, 1, tmp_path / "one-node.log"), tmp_path / "one-node.log")

    toml, two_nodes = write_run(tmp_path, "two-nodes", tiny_model, trainer_nodes=2, ranks=1)
    logs = [tmp_path / f"node{n}.log" for n in (1, 2)]
    procs = [start_node(toml, n, log) for n, log in zip((1, 2), logs, strict=True)]
    for proc, log in zip(procs, logs, strict=True):
        finish(proc, log)
    # Each node ran one torchrun agent of a 2-node world; its own logs and configs are apart.
    for n, log in zip((1, 2), logs, strict=True):
        assert f"(node {n}: trainer)" in log.read_text()
        assert (two_nodes / "logs" / f"node{n}" / "trainer.log").exists()
        assert (two_nodes / "configs" / f"node{n}" / "trainer.toml").exists()

    norms_one, weights_one = trained(one_node)
    norms_two, weights_two = trained(two_nodes)
    assert all(n > 0 for n in norms_one)
    for a, b in zip(norms_one, norms_two, strict=True):
        assert abs(a - b) <= 1e-5 * a, (norms_one, norms_two)
    base = load_file(next(Path(tiny_model).glob("*.safetensors")))
    assert max((weights_one[k] - base[k]).abs().max().item() for k in base) > 1e-4  # it trained
    for name, w in weights_one.items():
        torch.testing.assert_close(weights_two[name], w, rtol=1e-5, atol=1e-6, msg=f"{name} differs")


def two_free_ports() -> int:
    while True:
        port = free_port()
        with __import__("socket").socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def requests_running(port: int, run: Path) -> float:
    """From the server's `/metrics`, which takes only the run's signed requests."""
    try:
        key = hmac.new(secret.read(run / secret.FILE_NAME).encode(), b"requests", hashlib.sha256).digest()
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5, auth=Signed(key)).text
    except (OSError, httpx.HTTPError, secret.SecretError):
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:num_requests_running"))  # fmt: skip


def test_two_inference_servers_one_killed_mid_run_the_run_completes_on_the_other(tiny_model, tmp_path):
    steps, port = 8, two_free_ports()
    toml = write_config(
        tmp_path, tiny_model, "reverse-text", steps, extra="[deployment]\ninference_servers = 2\n"
    )
    toml.write_text(
        toml.read_text().replace("[inference.server]\nport = ", f"[inference.server]\nport = {port}\n#")
    )
    run, out = tmp_path / "run", tmp_path / "rl.out"
    with out.open("w") as sink:
        proc = subprocess.Popen(
            [RL, "@", str(toml)], stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        orch_metrics = run / "orchestrator" / "metrics.jsonl"
        wait_until(lambda: len(jsonl(orch_metrics)) >= 2, "2 orchestrator steps", [proc])
        # Kill it while it is generating, so that rollouts are lost with it.
        wait_until(lambda: requests_running(port + 1, run) > 0, "inference-1 to be generating", [proc])
        victim = next(
            p for p in psutil.Process(proc.pid).children()
            if "prime_rl.inference.vllm_server" in p.cmdline() and str(port + 1) in p.cmdline()
        )  # fmt: skip
        group = [victim, *victim.children(recursive=True)]
        os.killpg(victim.pid, signal.SIGKILL)
        _, left = psutil.wait_procs(group, timeout=60)
        assert not left, left
        killed_at = len(jsonl(orch_metrics))
        assert proc.wait(timeout=900) == 0, out.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    text = out.read_text()
    assert "inference-1 server exited with status -9 during the run; its work moves to inference-0" in text
    assert killed_at < steps  # the kill fell mid-run, and the steps after it were generated on inference-0
    trainer = jsonl(run / "trainer" / "metrics.jsonl")
    assert [m["step"] for m in trainer] == list(range(steps))  # each step trained once
    orch = jsonl(orch_metrics)
    assert [m["step"] for m in orch] == list(range(steps))
    last = orch[-1]
    pending = last["rollouts/all/inflight"] + last["rollouts/all/waiting"]
    buckets = sum(last[f"rollouts/all/{b}_total"] for b in ("trained", "filtered", "failed", "stale"))
    assert last["rollouts/all/dispatched_total"] == buckets + pending
    assert last["rollouts/all/failed_total"] > 0  # the rollouts it was generating, counted, not lost
    orch_log = (run / "logs" / "orchestrator.log").read_text()
    assert f"127.0.0.1:{port + 1} does not answer" in orch_log  # the orchestrator kept work off it


def test_collective_broadcast_puts_the_trainers_weights_on_two_real_servers_without_files(
    tiny_model, tmp_path
):
    steps, port = 4, two_free_ports()
    extra = '[deployment]\ninference_servers = 2\n[trainer.weight_broadcast]\ntype = "collective"\n'
    toml = write_config(tmp_path, tiny_model, "reverse-text", steps, extra=extra)
    text = toml.read_text().replace("[inference.server]\nport = ", f"[inference.server]\nport = {port}\n#")
    toml.write_text(text.replace("max_async_level = 1", "max_async_level = 0"))  # sampler = trainer's weights
    run = tmp_path / "run"
    rl = subprocess.Popen([RL, "@", str(toml)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # The review's hijack, all through the run: a neighbour reads the broadcast store's keys with
    # torch's own client (to learn an update's prefix and join its group as rank 0). It reads nothing.
    read: list = []
    done = threading.Event()

    def neighbour() -> None:
        config = run / "configs" / "trainer.toml"
        while not done.wait(0.3):  # (a try every 0.3 s at most, until the run is over)
            try:
                store_port = tomllib.loads(config.read_text())["weight_broadcast"]["port"]
                client = torch.distributed.TCPStore("127.0.0.1", store_port, is_master=False,
                                                    timeout=timedelta(seconds=2), wait_for_workers=False)  # fmt: skip
                read.append(client.list_keys())
            except Exception:
                continue

    attacker = threading.Thread(target=neighbour, daemon=True)
    attacker.start()
    out, _ = rl.communicate(timeout=900)
    done.set()
    attacker.join(timeout=60)
    assert rl.returncode == 0, out[-6000:]
    assert read == []

    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    published = sorted((run / "weights").glob("step_*"))
    assert published and not list((run / "weights").rglob("*.safetensors"))  # no file per step
    for folder in published:
        assert json.loads((folder / "BROADCAST").read_text())["servers"] == urls
    trainer = jsonl(run / "trainer" / "metrics.jsonl")
    # (A publish finishes in the background: a step's line reports the one before.)
    assert [m.get("weights/broadcast") for m in trainer[1:]] == [1.0] * (steps - 1)
    # Synchronous: each step's rollouts come from the weights the trainer broadcast after the step
    # before. Had they not arrived (or arrived wrong), the trainer's logprobs would differ from the
    # servers' by far more (one step moves the policy by a KL of ~1e-2).
    assert max(m["mismatch_kl/all/mean"] for m in trainer) < 1e-4, [
        m["mismatch_kl/all/mean"] for m in trainer
    ]
    # A group that broke is formed once more (a server that took the first attempt takes it again).
    retries = (run / "logs" / "trainer.log").read_text().count("trying once more with a new group")
    for i in range(2):
        log = (run / "logs" / f"inference-{i}.log").read_text()
        took = log.count('POST /prime_rl/receive_weights HTTP/1.1" 200')
        assert steps <= took <= steps + retries, (f"inference-{i}", took, retries)
