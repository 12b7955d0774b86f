"""The sbatch jobs `rl` renders with `deployment.type = "slurm"` (`slurm.py`): config only."""

from pydantic import Field

from prime_rl.config import BaseConfig


class SlurmConfig(BaseConfig):
    """The sbatch job `rl` renders with `deployment.type = "slurm"`: one node per entry of
    `deployment.nodes` (one node running everything when it is empty), one `rl` per node."""

    job_name: str = "prime-rl"
    """`#SBATCH --job-name`."""

    partition: str | None = None
    """`#SBATCH --partition` (default: the cluster's)."""

    account: str | None = None
    """`#SBATCH --account`."""

    time_limit: str | None = None
    """`#SBATCH --time`, e.g. '04:00:00' (default: the partition's)."""

    cpus_per_node: int | None = Field(default=None, ge=1)
    """`#SBATCH --cpus-per-task` (one task per node: `rl` starts that node's processes itself)."""

    gpus_per_node: int | None = Field(default=None, ge=1)
    """`#SBATCH --gpus-per-node`."""

    sbatch_args: list[str] = []
    """More `#SBATCH` options, as written after it, e.g. ['--exclusive', '--mem=0']."""

    setup: list[str] = []
    """Shell lines every node runs first, e.g. ['module load cuda', 'source .venv/bin/activate']."""

    rl_command: str | None = None
    """How the nodes start `rl` (default: the absolute path of the `rl` that renders the job; the
    same install must be reachable from every node)."""

    inference_array: int | None = Field(default=None, ge=0)
    """Inference servers as a job array beside the run's job, this many tasks (0: the script only),
    each an `inference` that joins the run: `<output_dir>/slurm/inference.sbatch`. Grow the pool with
    `sbatch --array=N-M` of it, shrink it with `scancel --batch --signal=TERM <id>_<task>`."""

    inference_array_port: int = Field(default=8200, ge=1, le=65535)
    """Task K of the array serves on this port + K."""

    inference_array_args: list[str] = []
    """More `#SBATCH` options for each server of the array, e.g. ['--gpus-per-task=1', '--mem=64G']."""
