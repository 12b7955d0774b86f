"""`rl` with `deployment.type = "slurm"`: render one sbatch job for the whole run, and submit it.

The job allocates one node per entry of `deployment.nodes` (one node when the list is empty) and runs
one `rl` per node with the same config, written next to the script, plus a small TOML the job writes
at start with the node list SLURM gave it (hosts in allocation order, roles from the config). So a
node's `rl` is exactly the local multi-node `rl`: the one code path for a cluster with or without
SLURM. Invariant: the job ends when the nodes that run the orchestrator or a trainer have all ended
(inference-only nodes serve until then, and are stopped), or as soon as one of them fails, with its
status.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from prime_rl.config.cli import to_toml
from prime_rl.rl.config import RLConfig


class SlurmError(RuntimeError):
    """The job could not be submitted."""


def job_dir(config: RLConfig) -> Path:
    return Path(config.output_dir).resolve() / "slurm"


def node_config(config: RLConfig) -> RLConfig:
    """What every node's `rl` reads: the same run, started locally; the nodes come from the job."""
    deployment = config.deployment.model_copy(update={"type": "local", "nodes": [], "node": 0})
    return config.model_copy(update={"deployment": deployment})


def render(config: RLConfig, config_path: Path, workdir: Path) -> str:
    d, s = config.deployment, config.deployment.slurm
    out = job_dir(config)
    rl = s.rl_command or shlex.quote(str(Path(sys.executable).parent / "rl"))
    nodes = max(1, len(d.nodes))
    options = [
        f"--job-name={s.job_name}",
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
        f"--chdir={workdir}",
        f"--output={out}/%j.out",
    ]
    options += [f"--partition={s.partition}"] * bool(s.partition) + [f"--account={s.account}"] * bool(
        s.account
    )
    options += [f"--time={s.time_limit}"] * bool(s.time_limit)
    options += [f"--cpus-per-task={s.cpus_per_node}"] * bool(s.cpus_per_node)
    options += [f"--gpus-per-node={s.gpus_per_node}"] * bool(s.gpus_per_node)
    options += list(s.sbatch_args)
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {o}" for o in options),
        "",
        f"# Rendered by `rl` for the run in {config.output_dir}: one `rl` per node, all reading",
        f"# {config_path}, each with its own --deployment.node.",
        "export PYTHONUNBUFFERED=1",
        *s.setup,
        "",
    ]
    start = f"{rl} @ {shlex.quote(str(config_path))}"
    if not d.nodes:
        lines += [f"srun --nodes=1 --ntasks=1 {start}", "exit $?"]
        return "\n".join(lines) + "\n"
    roles = " ".join(shlex.quote("[" + ", ".join(f'"{r}"' for r in n.roles) + "]") for n in d.nodes)
    workers = " ".join(str(i) for i, n in enumerate(d.nodes) if {"orchestrator", "trainer"} & set(n.roles))
    lines += [
        'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f"ROLES=({roles})",
        f'NODES="{out}/nodes-$SLURM_JOB_ID.toml"',
        ': > "$NODES"',
        'for i in "${!ROLES[@]}"; do',
        '  printf \'[[deployment.nodes]]\\nhost = "%s"\\nroles = %s\\n\' "${HOSTS[$i]}" "${ROLES[$i]}" >> "$NODES"',
        "done",
        "PIDS=()",
        'for i in "${!ROLES[@]}"; do',
        f'  srun --nodes=1 --ntasks=1 --relative="$i" {start} @ "$NODES" --deployment.node "$i" &',
        "  PIDS[$i]=$!",
        "done",
        "# Wait for the nodes that run the orchestrator or a trainer; stop everything at the first failure.",
        f"LEFT=({workers})",
        "status=0",
        "while [ ${#LEFT[@]} -gt 0 ] && [ $status -eq 0 ]; do",
        "  NEXT=()",
        '  for i in "${LEFT[@]}"; do',
        '    if kill -0 "${PIDS[$i]}" 2>/dev/null; then NEXT+=("$i"); else wait "${PIDS[$i]}" || status=$?; fi',
        "  done",
        '  LEFT=("${NEXT[@]}")',
        "  [ ${#LEFT[@]} -gt 0 ] && [ $status -eq 0 ] && sleep 5",
        "done",
        'kill -TERM "${PIDS[@]}" 2>/dev/null',
        "wait",
        "exit $status",
    ]
    return "\n".join(lines) + "\n"


def prepare(config: RLConfig) -> Path:
    """Write the nodes' config and the job script under <output_dir>/slurm/; the script's path."""
    folder = job_dir(config)
    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "rl.toml"
    config_path.write_text(to_toml(node_config(config)))
    script = folder / "job.sbatch"
    script.write_text(render(config, config_path, Path.cwd()))
    return script


def dry_run(config: RLConfig) -> str:
    """What `rl --dry-run` prints with type = 'slurm': the job script (also written, to submit by hand)."""
    script = prepare(config)
    sys.stderr.write(f"rl: wrote {script} and {script.parent / 'rl.toml'}; submit it with: sbatch {script}\n")
    return script.read_text()


def submit(config: RLConfig) -> int:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise SlurmError(
            "deployment.type = 'slurm', but there is no `sbatch` here; run on a SLURM login node, or "
            "print the job with --dry-run"
        )
    script = prepare(config)
    done = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SlurmError(f"sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()}")
    job = done.stdout.strip().split(";")[0]
    print(
        f"rl: submitted SLURM job {job} ({script}); its output: {job_dir(config) / (job + '.out')}",
        flush=True,
    )
    return 0
