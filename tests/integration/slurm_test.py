"""`rl` with deployment.type = "slurm" against a real SLURM (Debian's slurm-wlm and munge): a
private one-node cluster, munged + slurmctld + slurmd, started by the fixture with its own key,
socket, state folders and ports. The rendered job is submitted with sbatch and its 2-step RL run
completes. Skipped, saying why, where the packages (or root) are missing."""

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

from prime_rl.monitor import read_metrics
from prime_rl.net import free_port

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
        f"PartitionName=main Nodes={host} Default=YES MaxTime=INFINITE State=UP\n"
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
