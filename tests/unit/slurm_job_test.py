"""The sbatch job `rl` renders with deployment.type = "slurm", run by bash against stand-ins for
srun and scontrol (the real SLURM run is tests/integration/slurm_test.py): one `rl` per node with the
job's hosts, inference-only nodes stopped when the workers end, everything stopped at a failure.
Paths in the script are data: a run folder with spaces, quotes and shell code in its name is one
argument to sbatch and to the shell, and what an #SBATCH line cannot carry is refused in one line;
the nodes' config hides its secrets and the nodes read them back."""

import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from prime_rl.config import parse_config
from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.slurm import SlurmError, prepare

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


def render(
    tmp_path: Path, extra: str = "", nodes: str = NODES, run: str = "run", cwd: Path | None = None
) -> Path:
    toml = tmp_path / "rl.toml"
    toml.write_text(f'output_dir = "{tmp_path / run}"\n[deployment]\ntype = "slurm"\n{extra}\n{nodes}')
    done = subprocess.run(
        [RL, "@", str(toml), "--dry-run"], capture_output=True, text=True, timeout=120, cwd=cwd
    )
    assert done.returncode == 0, done.stderr
    script = tmp_path / run / "slurm" / "job.sbatch"
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


def run_job(tmp_path, fake_slurm, behaviour: dict[int, str], run: str = "run") -> tuple[int, list[str]]:
    env, fake_rl, log = fake_slurm
    script = render(tmp_path, f'[deployment.slurm]\nrl_command = "{fake_rl}"\n', run=run)
    env = {**env, **{f"FAKE_{i}": b for i, b in behaviour.items()}}
    done = subprocess.run(
        ["bash", str(script)], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    nodes = (tmp_path / run / "slurm" / "nodes-7.toml").read_text()
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


ODD = "my run's $(touch PWNED); touch PWNED2 #x"
"""A run folder name with a space, a quote, a command substitution, a `;` and a `#`."""


def test_an_odd_run_folder_is_one_argument_to_the_shell_and_runs_nothing(tmp_path, fake_slurm):
    code, log = run_job(tmp_path, fake_slurm, {0: "600 0", 1: "1 0", 2: "1 0"}, run=ODD)
    assert code == 0 and {"start 0 3", "start 1 3", "start 2 3"} <= set(log), log
    assert not list(tmp_path.rglob("PWNED*"))
    assert subprocess.run(["bash", "-n", str(tmp_path / ODD / "slurm" / "job.sbatch")]).returncode == 0


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="needs sbatch (not a cluster) to parse a job")
def test_sbatch_reads_an_odd_run_folder_and_working_directory_whole(tmp_path):
    workdir = tmp_path / "work dir #2 'x'"
    workdir.mkdir()
    script = render(
        tmp_path, '[deployment.slurm]\nsbatch_args = ["--comment=a b # c"]\n', run=ODD, cwd=workdir
    )
    # sbatch parses the #SBATCH lines before it needs a controller; a stand-in config is enough.
    # (MessageTimeout: sbatch then gives up on the absent controller at once, not after 18 s of retries.)
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=t\nSlurmctldHost=localhost\nMessageTimeout=1\nNodeName=localhost CPUs=1\n"
        "PartitionName=p Nodes=localhost\n"
    )
    env = {**os.environ, "SLURM_CONF": str(conf)}
    done = subprocess.run(
        ["sbatch", "-v", "--test-only", str(script)], capture_output=True, text=True, env=env, timeout=60
    )
    parsed = done.stderr
    assert "Invalid directive" not in parsed, parsed
    out = tmp_path.resolve() / ODD / "slurm"
    for option in (f": {workdir.resolve()}\n", f": {out}/%j.out\n", ": a b # c\n", ": 3\n"):
        assert option in parsed, (option, parsed)


def test_what_an_sbatch_line_cannot_carry_is_refused_in_one_line(tmp_path):
    for run, what in (("a\nb", "output_dir"), ('a"b', "output_dir"), ("50%", "output_dir")):
        config = RLConfig(output_dir=tmp_path / run, deployment={"type": "slurm"})
        with pytest.raises(SlurmError, match=what) as e:
            prepare(config)
        assert "\n" not in str(e.value).replace("\\n", "") and not (tmp_path / run).exists()
    config = RLConfig(
        output_dir=tmp_path / "run", deployment={"type": "slurm", "slurm": {"sbatch_args": ['--x="y"']}}
    )
    with pytest.raises(SlurmError, match=r"deployment\.slurm\.sbatch_args\[0\]"):
        prepare(config)
    # From the command line (--dry-run too): one line, no traceback.
    toml = tmp_path / "rl.toml"
    toml.write_text(f'output_dir = "{tmp_path}/50%"\n[deployment]\ntype = "slurm"\n')
    done = subprocess.run([RL, "@", str(toml), "--dry-run"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert done.stderr.startswith("rl: error: output_dir:"), done.stderr


def test_the_nodes_config_hides_a_key_and_the_nodes_read_it_back(tmp_path):
    key = "sk-judge-0123456789"
    env = {"id": "reverse_text", "args": {"api_key": key}}
    config = RLConfig(output_dir=tmp_path / "run", deployment={"type": "slurm"}, orchestrator={"envs": [env]})
    script = prepare(config)
    assert key not in script.read_text() and key not in (script.parent / "rl.toml").read_text()
    assert stat.S_IMODE((script.parent / "rl.secrets.toml").stat().st_mode) == 0o600
    [start] = [line for line in script.read_text().splitlines() if line.startswith("srun ")]
    args = shlex.split(start)[4:]  # after `srun --nodes=1 --ntasks=1 <rl>`
    assert parse_config(RLConfig, args).orchestrator.envs[0].args["api_key"] == key
