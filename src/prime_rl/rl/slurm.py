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

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from prime_rl.config.files import config_args, write_config
from prime_rl.rl.config import RLConfig


class SlurmError(RuntimeError):
    """The job could not be submitted."""


def job_dir(config: RLConfig) -> Path:
    return Path(config.output_dir).resolve() / "slurm"


def node_config(config: RLConfig) -> RLConfig:
    """What every node's `rl` reads: the same run, started locally; the nodes come from the job."""
    deployment = config.deployment.model_copy(update={"type": "local", "nodes": [], "node": 0})
    return config.model_copy(update={"deployment": deployment})


_UNSBATCHABLE = re.compile(r'[\x00-\x1f\x7f"\\]')
"""What an `#SBATCH` line cannot carry as we write it: a line break or other control character
(sbatch reads the script line by line), a double quote (our quotes) or a backslash (sbatch's escape,
and in --output it turns off the %j that names the job's file)."""


def sbatch_arg(option: str, what: str) -> str:
    """`option` as one argument of an `#SBATCH` line: sbatch splits the line at whitespace outside
    quotes, and an unquoted `#` starts a comment. Refused (one line naming `what`) when it holds a
    character the line cannot carry."""
    if _UNSBATCHABLE.search(option):
        raise SlurmError(
            f"{what}: {option!r} cannot go on an #SBATCH line (a control character, a '\"' or a '\\')"
        )
    return f'"{option}"' if re.search(r"[\s#']", option) else option


def _path(path: Path, what: str) -> str:
    """A folder of the job's, checked for what an #SBATCH line cannot carry, and for a '%': sbatch
    reads %j and the like in --output as a pattern."""
    text = str(path)
    sbatch_arg(text, what)
    if "%" in text:
        raise SlurmError(f"{what}: {text!r} holds a '%', which SLURM reads as a pattern in a job's paths")
    return text


def render(config: RLConfig, config_args: list[str], workdir: Path) -> str:
    """The job script; `config_args`: how the nodes' `rl` reads its config (`write_config`)."""
    d, s = config.deployment, config.deployment.slurm
    out = _path(job_dir(config), "output_dir")
    rl = s.rl_command or shlex.quote(str(Path(sys.executable).parent / "rl"))
    key = "deployment.slurm."
    options = [
        (f"--job-name={s.job_name}", key + "job_name"),
        (f"--nodes={max(1, len(d.nodes))}", ""),
        ("--ntasks-per-node=1", ""),
        (f"--chdir={_path(workdir, 'the working directory')}", ""),
        (f"--output={out}/%j.out", ""),
    ]
    options += [(f"--partition={s.partition}", key + "partition")] * bool(s.partition)
    options += [(f"--account={s.account}", key + "account")] * bool(s.account)
    options += [(f"--time={s.time_limit}", key + "time_limit")] * bool(s.time_limit)
    options += [(f"--cpus-per-task={s.cpus_per_node}", "")] * bool(s.cpus_per_node)
    options += [(f"--gpus-per-node={s.gpus_per_node}", "")] * bool(s.gpus_per_node)
    options += [(a, f"{key}sbatch_args[{i}]") for i, a in enumerate(s.sbatch_args)]
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {sbatch_arg(o, what)}" for o, what in options),
        "",
        f"# Rendered by `rl` for the run in {Path(out).parent}: one `rl` per node, all reading",
        f"# {config_args[1]}, each with its own --deployment.node.",
        "export PYTHONUNBUFFERED=1",
        *s.setup,
        "",
    ]
    start = " ".join([rl, *map(shlex.quote, config_args)])
    if not d.nodes:
        lines += [f"srun --nodes=1 --ntasks=1 {start}", "exit $?"]
        return "\n".join(lines) + "\n"
    roles = " ".join(shlex.quote("[" + ", ".join(f'"{r}"' for r in n.roles) + "]") for n in d.nodes)
    workers = " ".join(str(i) for i, n in enumerate(d.nodes) if {"orchestrator", "trainer"} & set(n.roles))
    lines += [
        'mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
        f"ROLES=({roles})",
        f'NODES={shlex.quote(out)}/nodes-"$SLURM_JOB_ID".toml',
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
    folder, node = job_dir(config), node_config(config)
    text = render(config, config_args(folder / "rl.toml", node), Path.cwd())  # before writing anything
    folder.mkdir(parents=True, exist_ok=True)
    write_config(folder / "rl.toml", node)
    script = folder / "job.sbatch"
    script.write_text(text)
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
