"""Where trainer checkpoints live, readable without torch (the orchestrator reads it to know which
batches a restarted trainer may still need).

`<output_dir>/checkpoints/step_<N>/` holds the state after N optimizer steps; `DONE` in it is
written last, so only folders with `DONE` count as complete.
"""

import re
from pathlib import Path

DONE = "DONE"
_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def complete_steps(root: Path) -> list[int]:
    """Steps with a complete checkpoint under `root`, ascending."""
    if not root.exists():
        return []
    return sorted(
        int(m.group(1)) for p in root.iterdir() if (m := _STEP.match(p.name)) and (p / DONE).exists()
    )
