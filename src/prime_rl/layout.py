"""The output folder that the processes of a run share, readable without torch or vLLM.

`<output_dir>/`:
- `checkpoints/step_<N>/`: the trainer's state after N optimizer steps; `DONE` in it is written
  last, so only folders with `DONE` are complete.
- `weights/step_<N>/`: the weights after N steps as an HF folder for inference; `READY` in it is
  written last, so only folders with `READY` are loaded. With the collective weight broadcast the
  folder holds only `BROADCAST` (the servers that took the weights in memory) and `READY`, unless the
  broadcast failed and the files were written instead.
- `orchestrator/` (progress, metrics, saved batches), `trainer/` (metrics), `rollouts/step_<N>.jsonl`,
  `transport/` (the filesystem transport), `inference/` (server logs, temporary files).

Invariant: a folder is complete once its marker exists; writers create the marker last.
"""

from __future__ import annotations

import re
from pathlib import Path

DONE = "DONE"
READY = "READY"
BROADCAST = "BROADCAST"
_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def weights_root(output_dir: Path) -> Path:
    return Path(output_dir) / "weights"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def marked_steps(root: Path, marker: str) -> list[int]:
    """Steps N with `step_<N>/<marker>` under `root`, ascending."""
    try:
        entries = list(Path(root).iterdir())
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for p in entries if (m := _STEP.match(p.name)) and (p / marker).exists())


def complete_steps(root: Path) -> list[int]:
    """Steps with a complete checkpoint under `root` (a `checkpoint_root`), ascending."""
    return marked_steps(root, DONE)


def latest_ready_step(root: Path) -> int | None:
    """The newest step with published weights under `root` (a `weights_root`), or None."""
    steps = marked_steps(root, READY)
    return steps[-1] if steps else None
