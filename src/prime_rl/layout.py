"""The output folder that the processes of a run share, readable without torch or vLLM.

`<output_dir>/`:
- `checkpoints/step_<N>/`: the trainer's state after N optimizer steps; `MANIFEST.json` (each
  file's size and CRC-32) and then `DONE` are written last, so only folders with `DONE` are
  complete, and `verify_checkpoint` tells a complete one that storage damaged since.
- `weights/step_<N>/`: the weights after N steps as an HF folder for inference; `READY` in it is
  written last, so only folders with `READY` are loaded. With the collective weight broadcast the
  folder holds only `BROADCAST` (the servers that took the weights in memory) and `READY`, unless the
  broadcast failed and the files were written instead.
- `trainer/refused.json`: written by a trainer whose config cannot work with the orchestrator's
  (the run contract); the orchestrator of that session stops with the same line.
- `restarts.jsonl`: one record per process `rl` restarted (`deployment.max_restarts`): time,
  process, the status it died with, and its restart count.
- `orchestrator/` (progress, metrics, saved batches), `trainer/` (metrics), `rollouts/step_<N>.jsonl`,
  `transport/` (the filesystem transport), `inference/` (server logs, temporary files).

Invariant: a folder is complete once its marker exists; writers create the marker last.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path

DONE = "DONE"
MANIFEST = "MANIFEST.json"
READY = "READY"
BROADCAST = "BROADCAST"
TRAINER_STATS = "trainer_stats.json"
"""In a published step's folder: the trainer step's mismatch figures that produced these weights
(`is_ratio_ess`, `mismatch_kl`), which the orchestrator's adaptive async level reads."""
_STEP = re.compile(r"^step_(\d+)$")


def checkpoint_root(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def weights_root(output_dir: Path) -> Path:
    return Path(output_dir) / "weights"


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def read_trainer_stats(root: Path, step: int) -> dict | None:
    """The trainer's stats published with `step`'s weights, or None (none written, or unreadable)."""
    try:
        stats = json.loads((step_dir(root, step) / TRAINER_STATS).read_text())
    except (OSError, ValueError):
        return None
    return stats if isinstance(stats, dict) else None


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


def refusal_path(output_dir: Path) -> Path:
    """Where a trainer that refused the orchestrator's side of the run contract says why
    (`prime_rl.contract`): JSON with the orchestrator's session and the one-line reason."""
    return Path(output_dir) / "trainer" / "refused.json"


def restarts_path(output_dir: Path) -> Path:
    return Path(output_dir) / "restarts.jsonl"


def restart_counts(output_dir: Path) -> dict[str, int]:
    """How often `rl` restarted each process of the run so far (process kind -> count)."""
    counts: dict[str, int] = {}
    try:
        lines = restarts_path(output_dir).read_text().splitlines()
    except FileNotFoundError:
        return counts
    for line in lines:
        try:
            kind = json.loads(line)["process"]
        except (ValueError, KeyError):
            continue  # a line cut short by a full disk
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def _digest(path: Path) -> str:
    """CRC-32 of the file: catches what storage does to a file (truncation, torn or flipped blocks)
    at memory speed (4 GB/s here, 6x SHA-256), so verifying a checkpoint costs about one read."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(2**22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def write_manifest(folder: Path) -> None:
    """Record every file under `folder` (relative path, size, CRC-32) in its MANIFEST.json."""
    folder = Path(folder)
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in (MANIFEST, DONE))
    entries = {str(p.relative_to(folder)): {"size": p.stat().st_size, "crc32": _digest(p)} for p in files}
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"files": entries}, indent=1))
    os.replace(tmp, folder / MANIFEST)


def verify_checkpoint(folder: Path) -> str | None:
    """Why the checkpoint in `folder` cannot be trusted (missing, incomplete, a file missing, of
    another size or content than its manifest says), or None when it is intact. A complete
    checkpoint written before manifests existed is trusted as it is."""
    folder = Path(folder)
    if not (folder / DONE).exists():
        return f"{folder} is not a complete checkpoint (no {DONE})"
    if not (folder / MANIFEST).exists():
        return None
    try:
        files = json.loads((folder / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"{folder / MANIFEST} cannot be read ({e})"
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{path} is {size} bytes, its manifest says {want['size']}"
        if _digest(path) != want["crc32"]:
            return f"{path} does not match its checksum in {MANIFEST}"
    return None
