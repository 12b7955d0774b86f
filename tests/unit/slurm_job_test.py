"""The sbatch job `rl` renders with deployment.type = "slurm", run by bash against stand-ins for
srun and scontrol (the real SLURM run is tests/integration/slurm_test.py): one `rl` per node with the
job's hosts, inference-only nodes stopped when the workers end, everything stopped at a failure."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

RL = str(Path(sys.executable).parent / "rl")
NODES = """
[[deployment.nodes]]
roles = ["inference"]
[[deployment.nodes]]
roles = ["inference", "orchestrator"]
[[deployment.nodes]]
roles = ["trainer"]
"""


def executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def render(tmp_path: Path, extra: str = "", nodes: str = NODES) -> Path:
    toml = tmp_path / "rl.toml"
    toml.write_text(f'output_dir = "{tmp_path / "run"}"\n[deployment]\ntype = "slurm"\n{extra}\n{nodes}')
    done = subprocess.run([RL, "@", str(toml), "--dry-run"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    script = tmp_path / "run" / "slurm" / "job.sbatch"
    assert done.stdout == script.read_text() and f"sbatch {script}" in done.stderr
    return script


def test_the_job_allocates_one_node_per_entry_and_starts_rl_on_each(tmp_path):
    script = render(tmp_path, '[deployment.slurm]\npartition = "gpu"\ngpus_per_node = 8\ntime_limit = "2:00:00"\n'
                    'sbatch_args = ["--exclusive"]\nsetup = ["module load cuda"]\n')  # fmt: skip
    text = script.read_text()
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=1", "#SBATCH --partition=gpu",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --time=2:00:00", "#SBATCH --exclusive",
                 f"#SBATCH --chdir={Path.cwd()}", "module load cuda"):  # fmt: skip
        assert line in text.splitlines(), line
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    # The nodes read the run's config, started locally, with their hosts from the job.
    node_toml = (tmp_path / "run" / "slurm" / "rl.toml").read_text()
    assert 'type = "local"' in node_toml and "nodes = []" in node_toml

    (tmp_path / "one").mkdir()
    single = render(tmp_path / "one", nodes="")
    assert "#SBATCH --nodes=1" in single.read_text() and "srun --nodes=1 --ntasks=1" in single.read_text()


@pytest.fixture
def fake_slurm(tmp_path):
    """`srun` runs its command here; `scontrol show hostnames` names three hosts; `rl` is a stand-in
    whose behaviour per node comes from FAKE_<node> (seconds to live, then an exit status)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "srun", '#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\nexec "$@"\n')
    executable(bin_dir / "scontrol", "#!/bin/bash\nprintf 'host-a\\nhost-b\\nhost-c\\n'\n")
    log = tmp_path / "nodes.log"
    fake_rl = executable(
        bin_dir / "fake-rl",
        f"""#!/bin/bash
node=${{@: -1}}
echo "start $node $(grep -c '^host = ' "${{@: -3:1}}")" >> {log}
trap 'kill $child; echo "stopped $node" >> {log}; exit 143' TERM
read seconds code <<< "$(eval echo \\$FAKE_$node)"
sleep "$seconds" & child=$!
wait $child
echo "exit $node $code" >> {log}
exit "$code"
""",
    )
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NODELIST": "x",
    }
    return env, fake_rl, log


def run_job(tmp_path, fake_slurm, behaviour: dict[int, str]) -> tuple[int, list[str]]:
    env, fake_rl, log = fake_slurm
    script = render(tmp_path, f'[deployment.slurm]\nrl_command = "{fake_rl}"\n')
    env = {**env, **{f"FAKE_{i}": b for i, b in behaviour.items()}}
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    nodes = (tmp_path / "run" / "slurm" / "nodes-7.toml").read_text()
    assert nodes.count("[[deployment.nodes]]") == 3 and 'host = "host-c"\nroles = ["trainer"]' in nodes
    return done.returncode, log.read_text().splitlines()


def test_inference_only_nodes_are_stopped_when_the_workers_finish(tmp_path, fake_slurm):
    code, log = run_job(tmp_path, fake_slurm, {0: "600 0", 1: "1 0", 2: "2 0"})
    assert code == 0, log
    assert {"start 0 3", "start 1 3", "start 2 3", "exit 1 0", "exit 2 0", "stopped 0"} <= set(log)


def test_a_failing_node_stops_the_job_with_its_status(tmp_path, fake_slurm):
    code, log = run_job(tmp_path, fake_slurm, {0: "600 0", 1: "600 0", 2: "1 3"})
    assert code == 3, log
    assert {"exit 2 3", "stopped 0", "stopped 1"} <= set(log)


def test_without_sbatch_rl_says_to_use_dry_run(tmp_path):
    toml = tmp_path / "rl.toml"
    toml.write_text(f'output_dir = "{tmp_path / "run"}"\n[deployment]\ntype = "slurm"\n')
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}
    done = subprocess.run([RL, "@", str(toml)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "there is no `sbatch` here" in done.stderr and "--dry-run" in done.stderr
