"""`rl` with deployment.type = "slurm" against a real SLURM (Debian's slurm-wlm and munge): a
private one-node cluster, munged + slurmctld + slurmd, started by the fixture with its own key,
socket, state folders and ports. The rendered job is submitted with sbatch and its 2-step RL run
completes; a run with an inference array grows by a task submitted mid-run, which joins, and
shrinks by one `scancel`led, which drains. Skipped, saying why, where the packages (or root) are
missing."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from rl_test import write_config

from prime_rl.runtime import activity
from prime_rl.runtime.monitor import read_metrics
from prime_rl.runtime.net import free_port

pytestmark = pytest.mark.slow

RL = str(Path(sys.executable).parent / "rl")
NEEDED = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "runuser")


def wait_for(condition, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def output(cmd: list[str], env: dict) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=30).stdout.strip()


@pytest.fixture(scope="module")
def slurm():
    missing = [c for c in NEEDED if shutil.which(c) is None]
    if missing:
        pytest.skip(
            f"needs SLURM and munge (apt-get install slurm-wlm munge): {', '.join(missing)} not found"
        )
    if os.geteuid() != 0:
        pytest.skip("needs root, to run slurmd and munged")
    munge = Path(tempfile.mkdtemp(prefix="prl-munge-"))
    (munge / "munge.key").write_bytes(os.urandom(1024))
    (munge / "munge.key").chmod(0o400)
    shutil.chown(munge, "munge", "munge")
    shutil.chown(munge / "munge.key", "munge", "munge")
    munge.chmod(0o711)  # munged checks its folder; slurm (root) must reach the socket
    sock = munge / "munge.socket"
    subprocess.run(["runuser", "-u", "munge", "--", "munged", f"--key-file={munge / 'munge.key'}", f"--socket={sock}",
                    f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
                    f"--seed-file={munge / 'munged.seed'}"], check=True, timeout=30)  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="prl-slurm-"))
    for d in ("state", "spool"):
        (root / d).mkdir()
    host = socket.gethostname().split(".")[0]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 - 1024
    cpus = len(os.sched_getaffinity(0))
    (root / "slurm.conf").write_text(
        f"ClusterName=prl\nSlurmctldHost={host}\nSlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\n"
        f"AuthInfo=socket={sock}\nCredType=cred/munge\nProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
        f"SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\nMpiDefault=none\nReturnToService=2\n"
        f"SlurmctldPort={free_port()}\nSlurmdPort={free_port()}\nStateSaveLocation={root / 'state'}\n"
        f"SlurmdSpoolDir={root / 'spool'}\nSlurmctldPidFile={root / 'slurmctld.pid'}\n"
        f"SlurmdPidFile={root / 'slurmd.pid'}\nSlurmctldLogFile={root / 'slurmctld.log'}\n"
        f"SlurmdLogFile={root / 'slurmd.log'}\n"
        f"NodeName={host} CPUs={cpus} RealMemory={mem} State=UNKNOWN\n"
        # Cores shared between jobs: the run's job and its inference array's tasks on the one node.
        f"PartitionName=main Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4\n"
    )
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    daemons = [subprocess.Popen([d, "-D", "-f", str(root / "slurm.conf")], env=env, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for d in ("slurmctld", "slurmd")]  # fmt: skip
    try:
        wait_for(lambda: output(["sinfo", "-h", "-o", "%T"], env) == "idle", "the SLURM node to be idle", 60)
        yield env, cpus
    finally:
        subprocess.run(["scancel", "--user=root"], env=env, capture_output=True, timeout=30)
        for d in daemons:
            os.killpg(d.pid, signal.SIGTERM)
        for d in daemons:
            try:
                d.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(d.pid, signal.SIGKILL)
        pid = (munge / "munged.pid").read_text().strip() if (munge / "munged.pid").exists() else ""
        if pid:
            os.kill(int(pid), signal.SIGTERM)
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(munge, ignore_errors=True)


def test_a_two_step_run_submitted_through_sbatch_completes(slurm, tiny_model, tmp_path):
    env, cpus = slurm
    extra = (
        f'[deployment]\ntype = "slurm"\n[deployment.slurm]\njob_name = "prl-test"\ncpus_per_node = {cpus}\n'
    )
    toml = write_config(tmp_path, tiny_model, "reverse-text", steps=2, extra=extra)
    done = subprocess.run([RL, "@", str(toml)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    job = re.search(r"submitted SLURM job (\d+)", done.stdout).group(1)

    def state() -> str:
        return re.search(
            r"JobState=(\w+)", output(["scontrol", "show", "job", job], env) or "JobState=GONE"
        ).group(1)

    wait_for(lambda: state() not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"), f"job {job}", 900)
    run = tmp_path / "run"
    log = run / "slurm" / f"{job}.out"
    shown = log.read_text()[-4000:] if log.exists() else "(no job output)"
    assert state() == "COMPLETED", shown
    assert "rl: done" in shown
    assert [m["step"] for m in read_metrics(run / "trainer" / "metrics.jsonl")] == [0, 1]
    assert [m["step"] for m in read_metrics(run / "orchestrator" / "metrics.jsonl")] == [0, 1]


def test_an_inference_array_grows_by_a_task_that_joins_and_shrinks_by_one_that_drains(
    slurm, tiny_model, tmp_path
):
    """The run's job plus an inference array of one task; mid-run `sbatch --array=1` adds a second
    server, which joins; `scancel --batch --signal=TERM` of the first drains it (its task ends
    COMPLETED, status 0). The trainer is held (SIGSTOP, watchdog off) while each change happens, so the
    run cannot end first however slow the machine is. The run ends with every step once, and the
    array's last server stops by itself once the run is over."""
    env, cpus = slurm
    base = _two_free_ports()
    extra = (
        f'[deployment]\ntype = "slurm"\nstall_timeout_s = 0\n[deployment.slurm]\njob_name = "prl-pool"\n'
        f"cpus_per_node = {cpus}\ninference_array = 1\ninference_array_port = {base}\n"
    )
    steps = 16
    toml = write_config(tmp_path, tiny_model, "reverse-text", steps=steps, extra=extra)
    done = subprocess.run([RL, "@", str(toml)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    job = re.search(r"submitted SLURM job (\d+)", done.stdout).group(1)
    array = re.search(r"submitted the inference array (\d+)", done.stdout).group(1)
    run = tmp_path / "run"
    host = socket.gethostname()

    def state(job_id: str) -> str:
        shown = output(["scontrol", "show", "job", job_id], env)
        found = re.search(r"JobState=(\w+)", shown or "")
        return found.group(1) if found else "GONE"

    def log() -> str:
        path = run / "logs" / "orchestrator.log"
        return path.read_text() if path.exists() else ""

    def trainer(sig: signal.Signals) -> None:
        for s in activity.read_all(run / "activity"):
            if s.kind == "trainer" and s.running():
                os.kill(s.pid, sig)

    def steps_done() -> int:
        path = run / "trainer" / "metrics.jsonl"
        return len(read_metrics(path)) if path.exists() else 0

    def shown() -> str:
        out = run / "slurm" / f"{job}.out"
        return out.read_text()[-3000:] if out.exists() else "(no job output)"

    try:
        wait_for(lambda: steps_done() >= 2 or state(job) not in ("PENDING", "RUNNING"), "2 steps", 900)
        assert state(job) == "RUNNING", shown()
        trainer(signal.SIGSTOP)
        wait_for(
            lambda: f"inference server http://{host}:{base} joined the pool" in log(), "task 0 to join", 900
        )
        grown = subprocess.run(
            ["sbatch", "--parsable", "--array=1", str(run / "slurm" / "inference.sbatch")],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert grown.returncode == 0, grown.stderr
        added = grown.stdout.strip().split(";")[0]
        wait_for(
            lambda: f"inference server http://{host}:{base + 1} joined the pool" in log(),
            "task 1 to join",
            900,
        )
        subprocess.run(["scancel", "--batch", "--signal=TERM", f"{array}_0"], env=env, check=True, timeout=60)
        wait_for(
            lambda: f"inference server http://{host}:{base} left the pool" in log(), "task 0 to leave", 300
        )
        wait_for(lambda: state(f"{array}_0") not in ("RUNNING", "COMPLETING"), "task 0 to end", 300)
        trainer(signal.SIGCONT)
        wait_for(
            lambda: state(job) not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"), f"job {job}", 900
        )
        # The array's last server sees the run is over and stops by itself.
        wait_for(
            lambda: state(added) not in ("PENDING", "RUNNING", "COMPLETING"), "the added task to end", 300
        )
    finally:
        trainer(signal.SIGCONT)
    assert state(job) == "COMPLETED", shown()
    first = output(["scontrol", "show", "job", f"{array}_0"], env)
    assert "ExitCode=0:0" in first or state(f"{array}_0") in ("COMPLETED", "GONE"), first
    assert [m["step"] for m in read_metrics(run / "trainer" / "metrics.jsonl")] == list(range(steps))
    orch = read_metrics(run / "orchestrator" / "metrics.jsonl")
    assert [m["step"] for m in orch] == list(range(steps))
    assert "left the run's pool" in (run / "slurm" / f"inference-{array}_0.out").read_text()
    assert "the run this server joined is over" in (run / "slurm" / f"inference-{added}_1.out").read_text()


def _two_free_ports() -> int:
    """A port P such that P and P + 1 are free (the array's first two tasks)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("", port + 1))
            except OSError:
                continue
        return port
