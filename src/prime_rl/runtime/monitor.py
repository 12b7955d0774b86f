"""Metrics out of a process: a local JSONL always, W&B when configured, one console line per step.

Invariant: logging never fails a run, except a full disk: the local JSONL is the run's record, so a
record that cannot be written stops the run with `DiskFull` (one line naming the file). W&B runs
offline when no API key is set, so it never waits on the network; a W&B error is reported once and
W&B is then skipped. The config W&B gets has its secret-looking values hidden (`config/redact.py`):
a judge's API key in an env's args must not end up on a shared dashboard.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from prime_rl.config import BaseConfig
from prime_rl.config.redact import redact
from prime_rl.runtime.disk import writing

log = logging.getLogger(__name__)


class WandbConfig(BaseConfig):
    """Weights & Biases logging (offline when no API key is set)."""

    enabled: bool = False
    """Log metrics to W&B."""

    project: str = "prime-rl"
    """W&B project."""

    name: str | None = None
    """Run name; defaults to the output folder's name."""


def stats(prefix: str, values: list[float]) -> dict[str, float]:
    """`<prefix>/mean`, `/std`, `/min`, `/max` of the values (nothing for an empty list)."""
    if not values:
        return {}
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / n)
    return {
        f"{prefix}/mean": mean,
        f"{prefix}/std": std,
        f"{prefix}/min": min(values),
        f"{prefix}/max": max(values),
    }


def _finite(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else None


class MetricsLogger:
    def __init__(
        self, path: Path, wandb_config=None, run_name: str | None = None, config: dict | None = None
    ):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._wandb = None
        if wandb_config is not None and wandb_config.enabled:
            self._wandb = self._init_wandb(wandb_config, run_name or self.path.parent.name, config)

    def _init_wandb(self, wandb_config, run_name: str, config: dict | None):
        try:
            import wandb

            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            return wandb.init(
                project=wandb_config.project,
                name=wandb_config.name or run_name,
                config=redact(config) if config is not None else None,
                mode=mode,
                dir=str(self.path.parent),
            )
        except Exception as e:
            log.warning("W&B disabled: %s", e)
            return None

    def log(self, step: int, metrics: dict[str, Any], axis: str | None = None) -> None:
        """Append one record. `axis` names a separate step metric (e.g. 'eval/step') for records that
        arrive out of order with the training steps, which W&B's own step must never go back on."""
        record = {"step": step, **{k: _finite(v) for k, v in metrics.items()}}
        with writing(self.path, f"the metrics of step {step}"), self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            try:
                if axis is None:
                    self._wandb.log(metrics, step=step)
                else:
                    prefix = axis.split("/")[0]
                    self._wandb.define_metric(axis)
                    self._wandb.define_metric(f"{prefix}/*", step_metric=axis)
                    self._wandb.log({**metrics, axis: step})
            except Exception as e:
                log.warning("W&B logging failed, skipping W&B from now on: %s", e)
                self._wandb = None

    def close(self) -> None:
        if self._wandb is not None:
            with contextlib.suppress(Exception):
                self._wandb.finish()


def forget_steps_from(path: Path, step: int, evals: bool = False) -> int:
    """Drop the per-step records of `step` and later (eval records too with `evals`), which a resumed
    process is about to log again, and a half-written last line; return how many records were
    dropped. Keeps the invariant that a metrics file holds one record per step of the run as it
    stands, whatever was killed where."""
    path = Path(path)
    if not path.exists():
        return 0
    records = read_metrics(path)
    keep = [r for r in records if r["step"] < step or (not evals and any(k.startswith("eval/") for k in r))]
    text = path.read_text()
    if len(keep) < len(records) or (text and not text.endswith("\n")):
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(path)
    return len(records) - len(keep)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics JSONL, in order. A last line still being written (no newline yet)
    is left out, so a running process's file can be read."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip() and line.endswith("\n")]
