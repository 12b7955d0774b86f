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
from prime_rl.launcher.config import RLConfig
from prime_rl.runtime import secret


class SlurmError(RuntimeError):
    """The job could not be submitted."""


def job_dir(config: RLConfig) -> Path:
    return Path(config.output_dir).resolve() / "slurm"


def node_config(config: RLConfig) -> RLConfig:
    """What every node's `rl` reads: the same run, started locally; the nodes come from the job.
    With an inference array, the orchestrator's pool listens where the array's nodes reach it."""
    deployment = config.deployment.model_copy(update={"type": "local", "nodes": [], "node": 0})
    update: dict = {"deployment": deployment}
    pool = config.orchestrator.pool
    if config.deployment.slurm.inference_array is not None and "host" not in pool.model_fields_set:
        orchestrator = config.orchestrator.model_copy(
            update={"pool": pool.model_copy(update={"host": "0.0.0.0"})}
        )
        update["orchestrator"] = orchestrator
    return config.model_copy(update=update)


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


DRAIN_MARGIN_S = 30
"""SLURM's warning before the time limit, beyond the servers' drain: their leave and vLLM's stop."""


def array_config(config: RLConfig):
    """What every task of the inference array serves: the run's policy server, joining its pool."""
    from prime_rl.launcher.wiring import served

    base = served(config, 0)
    out = Path(config.output_dir).resolve()
    return base.model_copy(
        update={"output_dir": out, "pool": base.pool.model_copy(update={"join": str(out)})}
    )


def render_array(config: RLConfig, config_args: list[str], workdir: Path) -> str:
    """The inference array's job script: one server per task (`config_args`: its config), on port
    `inference_array_port` + the task's index, which joins the run and drains on SIGTERM (SLURM sends
    it `pool.drain_s` + a margin before the time limit)."""
    s = config.deployment.slurm
    out = _path(job_dir(config), "output_dir")
    inference = shlex.quote(str(Path(sys.executable).parent / "inference"))
    key = "deployment.slurm."
    drain_s = int(config.inference.pool.drain_s) + DRAIN_MARGIN_S
    options = [
        (f"--job-name={s.job_name}-inference", key + "job_name"),
        ("--ntasks=1", ""),
        (f"--chdir={_path(workdir, 'the working directory')}", ""),
        (f"--output={out}/inference-%A_%a.out", ""),
        (f"--signal=B:TERM@{drain_s}", ""),
    ]
    options += [(f"--array=0-{s.inference_array - 1}", "")] * bool(s.inference_array)
    options += [(f"--partition={s.partition}", key + "partition")] * bool(s.partition)
    options += [(f"--account={s.account}", key + "account")] * bool(s.account)
    options += [(f"--time={s.time_limit}", key + "time_limit")] * bool(s.time_limit)
    options += [(a, f"{key}inference_array_args[{i}]") for i, a in enumerate(s.inference_array_args)]
    secret_file = shlex.quote(str(Path(config.output_dir).resolve() / secret.FILE_NAME))
    lines = [
        "#!/bin/bash",
        *(f"#SBATCH {sbatch_arg(o, what)}" for o, what in options),
        "",
        f"# Rendered by `rl` for the run in {Path(out).parent}: one inference server per task, which",
        "# joins the run's pool; SIGTERM (scancel --batch --signal=TERM <job>_<task>) drains it.",
        "export PYTHONUNBUFFERED=1",
        *s.setup,
        "",
        f"RUN_SECRET={secret_file}",
        f'export {secret.FILE_ENV}="${{{secret.FILE_ENV}:-$RUN_SECRET}}"',
        f"PORT=$(( {s.inference_array_port} + ${{SLURM_ARRAY_TASK_ID:-0}} ))",
        f'exec {inference} {" ".join(map(shlex.quote, config_args))} --server.host "$(hostname)" --server.port "$PORT"',
    ]
    return "\n".join(lines) + "\n"


def prepare(config: RLConfig) -> Path:
    """Write the nodes' config and the job script under <output_dir>/slurm/ (and the inference
    array's, with `slurm.inference_array`); the job script's path."""
    folder, node = job_dir(config), node_config(config)
    text = render(config, config_args(folder / "rl.toml", node), Path.cwd())  # before writing anything
    array = None
    if config.deployment.slurm.inference_array is not None:
        array = render_array(config, config_args(folder / "inference.toml", array_config(config)), Path.cwd())
    folder.mkdir(parents=True, exist_ok=True)
    write_config(folder / "rl.toml", node)
    script = folder / "job.sbatch"
    script.write_text(text)
    if array is not None:
        write_config(folder / "inference.toml", array_config(config))
        (folder / ARRAY_SCRIPT).write_text(array)
        # The run's secret exists before either job starts: the servers read it as they start.
        secret.create(Path(config.output_dir).resolve())
    return script


ARRAY_SCRIPT = "inference.sbatch"


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
    array = script.parent / ARRAY_SCRIPT
    if config.deployment.slurm.inference_array:
        done = subprocess.run([sbatch, "--parsable", str(array)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SlurmError(f"sbatch refused {array}: {done.stderr.strip() or done.stdout.strip()}")
        print(
            f"rl: submitted the inference array {done.stdout.strip().split(';')[0]} "
            f"({config.deployment.slurm.inference_array} server(s), {array}); grow it with "
            f"`sbatch --array=<from>-<to> {array}`, shrink it with `scancel --batch --signal=TERM <job>_<task>`",
            flush=True,
        )
    elif config.deployment.slurm.inference_array == 0:
        print(
            f"rl: wrote {array}: submit servers that join the run with `sbatch --array=0-<n> {array}`",
            flush=True,
        )
    return 0
