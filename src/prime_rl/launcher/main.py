"""`uv run rl @ rl.toml`: resolve one config into the three processes and run them together, or
render and submit the SLURM job that does (`deployment.type = "slurm"`)."""

import sys

from prime_rl.config import parse_config
from prime_rl.config.cli import to_toml
from prime_rl.launcher.config import RLConfig
from prime_rl.launcher.preflight import check_rl
from prime_rl.runtime.imports import heavy_imports


def _dry_run(config: RLConfig) -> str:
    if config.deployment.type == "slurm":
        from prime_rl.launcher.slurm import dry_run

        return dry_run(config)
    return to_toml(config, redacted=True)


def main(argv: list[str] | None = None) -> None:
    from prime_rl.launcher.slurm import SlurmError, submit

    try:
        # Every check that needs no process runs here, so a mistake costs seconds, not a vLLM start-up.
        with heavy_imports(freeze=True):  # the checks import the envs: this process's own start
            config = parse_config(RLConfig, argv, prog="rl", check=check_rl, dry_run=_dry_run)
        if config.deployment.type == "slurm":
            raise SystemExit(submit(config))
    except SlurmError as e:  # (a job that cannot be rendered, with --dry-run too, or submitted)
        sys.stderr.write(f"rl: error: {e}\n")
        raise SystemExit(1) from None
    from prime_rl.launcher.mode import resolve
    from prime_rl.launcher.supervisor import launch

    config, line = resolve(config)
    print(line, flush=True)
    raise SystemExit(launch(config))
