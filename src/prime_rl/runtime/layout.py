"""The output folder that the processes of a run share, readable without torch or vLLM.

`<output_dir>/`:
- `checkpoints/step_<N>/`: the trainer's state after N optimizer steps; `MANIFEST.json` (each
  file's size and hash) and then `DONE` are written last, so only folders with `DONE` are
  complete, and `verify_checkpoint` tells a complete one that storage damaged since. With a run
  secret (`prime_rl.runtime.secret`) the hashes are HMACs keyed by it, and the manifest carries a MAC over
  its folder's name and every file's name, size and hash: a checkpoint that anyone without the
  secret changed, added a file to, or moved is refused as a damaged one is; so is one whose
  manifest is unkeyed or missing (the way around the keys), unless `TRUST_UNKEYED` is set.
  Without a secret, the hashes are CRC-32s, which catch storage, not people.
- `weights/step_<N>/`: the weights after N steps as an HF folder for inference; `READY` in it is
  written last, so only folders with `READY` are loaded. With the collective weight broadcast the
  folder holds only `BROADCAST` (the servers that took the weights in memory) and `READY`, unless the
  broadcast failed and the files were written instead.
- `trainer/refused.json`: written by a trainer whose config cannot work with the orchestrator's
  (the run contract); the orchestrator of that session stops with the same line.
- `restarts.jsonl`: one record per process restarted (`rl`'s `deployment.max_restarts`, or the
  orchestrator's engine, `client.max_restarts`): time, process, the status it died with, and its
  restart count.
- `orchestrator/pool.json`: the address at which inference servers join the run (`{"url": ...}`).
- `orchestrator/` (progress, metrics, saved batches), `trainer/` (metrics), `rollouts/step_<N>.jsonl`,
  `transport/` (the filesystem transport), `inference/` (server logs, temporary files).

Invariant: a folder is complete once its marker exists; writers create the marker last.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import time
import zlib
from pathlib import Path

from prime_rl.runtime import secret

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
    (`prime_rl.transport.contract`): JSON with the orchestrator's session and the one-line reason."""
    return Path(output_dir) / "trainer" / "refused.json"


def pool_path(output_dir: Path) -> Path:
    """Where the orchestrator says at which address servers join its pool (`{"url": ...}`)."""
    return Path(output_dir) / "orchestrator" / "pool.json"


def restarts_path(output_dir: Path) -> Path:
    return Path(output_dir) / "restarts.jsonl"


def record_restart(output_dir: Path, process: str, name: str, status: int, restart: int) -> None:
    """One line of `restarts.jsonl`: `process` (its kind) `name` died with `status` and is started
    again for the `restart`-th time."""
    record = {"time": time.time(), "process": process, "name": name, "status": status, "restart": restart}
    path = restarts_path(output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def restart_counts(output_dir: Path) -> dict[str, int]:
    """How often each process of the run was restarted so far (process kind -> count): by `rl`, or,
    vLLM's engine in engine mode ("inference"), by the orchestrator."""
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


HASH_CHUNK = 2**22
"""Files are hashed 4 MiB at a time: a checkpoint shard is never read into memory whole."""

CRC32 = "crc32"
KEYED = "hmac-sha256"
"""The kinds of hash a manifest holds (its `hash` field, and each file's entry's name for its hash):
CRC-32 without a run secret (an older manifest has no `hash` field: CRC-32), HMAC-SHA-256 keyed by
the run secret with one. HMAC-SHA-256 rather than keyed BLAKE2b: on a CPU with SHA extensions (x86
since about 2019) it is twice as fast (1.8 GB/s against 0.94 on an EPYC core; CRC-32: 4.3 GB/s)."""

FILES_KEY = "checkpoint-files"
MANIFEST_KEY = "checkpoint-manifest"
"""The labels of the run secret's keys (`secret.key`) for the files' hashes and for the manifest's
own MAC: two keys, so that no hash of a file can ever pass for the MAC of a manifest. Published
weights have keys of their own (`WEIGHTS`), so that no checkpoint's manifest passes for theirs."""

CHECKPOINT, WEIGHTS = "checkpoint", "weights"
"""What a manifest vouches for: the label of its keys."""


def _labels(kind: str) -> tuple[str, str]:
    return f"{kind}-files", f"{kind}-manifest"


TRUST_UNKEYED = "PRIME_RL_TRUST_UNKEYED_CHECKPOINTS"
"""Set (to anything but 0) in the environment, a process with a run secret still takes a checkpoint
whose manifest is unkeyed or missing (saved without the secret, or by an earlier prime-rl), checking
its CRC-32s as before: the user vouches that nobody else wrote it."""


def _crc32(path: Path) -> str:
    """CRC-32 of the file: catches what storage does to a file (truncation, torn or flipped blocks)
    at memory speed, so verifying a checkpoint costs about one read."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _keyed(path: Path, key: bytes) -> str:
    """HMAC-SHA-256 of the file: catches what storage does, and what anyone without the key does."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            mac.update(chunk)
    return mac.hexdigest()


def _manifest_mac(manifest: dict, key: bytes) -> str:
    """The MAC of everything in a manifest but the MAC itself (hash kind, folder name, file names,
    sizes and hashes), over its canonical JSON: computed on what a reader parsed, so what is checked
    is exactly what is used."""
    body = {k: v for k, v in manifest.items() if k != "mac"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def _trust_unkeyed() -> bool:
    return os.environ.get(TRUST_UNKEYED, "").strip() not in ("", "0")


def _files(folder: Path) -> dict[str, Path]:
    """The files a manifest covers: every file under `folder` but the manifest and `DONE`."""
    return {
        str(p.relative_to(folder)): p
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST, DONE, READY)
    }


def write_manifest(folder: Path, what: str = CHECKPOINT) -> None:
    """Record every file under `folder` in its MANIFEST.json: relative path, size and hash (CRC-32,
    or keyed by the run secret when there is one, with a MAC over the whole manifest)."""
    folder = Path(folder)
    files_label, manifest_label = _labels(what)
    key = secret.key(files_label)
    if key is None:
        files = {name: {"size": p.stat().st_size, CRC32: _crc32(p)} for name, p in _files(folder).items()}
        manifest = {"hash": CRC32, "files": files}
    else:
        files = {
            name: {"size": p.stat().st_size, KEYED: _keyed(p, key)} for name, p in _files(folder).items()
        }
        manifest = {"hash": KEYED, "folder": folder.name, "files": files}
        manifest["mac"] = _manifest_mac(manifest, secret.key(manifest_label))
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, folder / MANIFEST)


def _unkeyed(folder: Path, what: str) -> str:
    return (
        f"{folder / MANIFEST} {what}, so a change by anyone who can write {folder.parent} would go unseen "
        f"(saved without the run secret, or by an earlier prime-rl); if you trust it, resume with {TRUST_UNKEYED}=1"
    )


def _check_keyed(folder: Path, manifest: dict, what: str) -> str | None:
    """Why a keyed manifest is not this run's manifest of exactly these files, or None."""
    path = folder / MANIFEST
    key = secret.key(_labels(what)[1])
    if key is None:
        return (
            f"{path} is keyed by a run secret and this process has none: set {secret.FILE_ENV} to the run's "
            f"secret file ({folder.parent.parent / secret.FILE_NAME} when `rl` made it) or {secret.ENV}"
        )
    if not hmac.compare_digest(str(manifest.get("mac")).encode(), _manifest_mac(manifest, key).encode()):
        return f"{path} does not match its MAC: changed since it was saved, or saved with another run secret"
    if manifest.get("folder") != folder.name:
        return f"{path} was saved for {manifest.get('folder')}, not {folder.name}: the checkpoint was moved"
    extra = sorted(set(_files(folder)) - set(manifest["files"]))
    if extra:
        return f"{folder / extra[0]} is not in {MANIFEST}: added since the checkpoint was saved"
    return None


def verify_weights(folder: Path) -> str | None:
    """Why the published weights in `folder` are not the run's trainer's (as `verify_checkpoint`,
    under the weights' own keys, `READY` for `DONE`): checked before a server or the engine loads
    them, so that someone who can write the run folder cannot plant a step. Without a run secret
    nothing can vouch for a folder: None (the server's route still wants `READY`)."""
    if secret.key(_labels(WEIGHTS)[0]) is None:
        return None
    return verify_checkpoint(folder, WEIGHTS)


def verify_checkpoint(folder: Path, what: str = CHECKPOINT) -> str | None:
    """Why the checkpoint in `folder` cannot be trusted (missing, incomplete, a file missing, added,
    of another size or content than its manifest says, the manifest changed), or None when it is
    intact. Without a run secret, a complete checkpoint written before manifests existed is trusted as
    it is; with one, only a manifest keyed by it is (or, with `TRUST_UNKEYED` set, an unkeyed one)."""
    folder = Path(folder)
    marker = DONE if what == CHECKPOINT else READY
    if not (folder / marker).exists():
        return f"{folder} is not a complete {what} (no {marker})"
    files_label = _labels(what)[0]
    # Deleting a manifest or rewriting it unkeyed must not get around the keys.
    strict = secret.key(files_label) is not None and not _trust_unkeyed()
    if not (folder / MANIFEST).exists():
        return _unkeyed(folder, "is missing") if strict else None
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files, kind = manifest["files"], manifest.get("hash", CRC32)
        if not isinstance(files, dict):
            raise TypeError("its files are not a mapping")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{folder / MANIFEST} cannot be read ({type(e).__name__}: {e})"
    if kind == KEYED:
        problem = _check_keyed(folder, manifest, what)
        if problem:
            return problem
    elif kind != CRC32:
        return f"{folder / MANIFEST} holds hashes of an unknown kind ({kind!r})"
    elif strict:
        return _unkeyed(folder, "is not keyed by the run secret")
    for name, want in files.items():
        path = folder / name
        try:
            if not path.is_file():
                return f"{path} is missing"
            size = path.stat().st_size
            if size != want["size"]:
                return f"{path} is {size} bytes, its manifest says {want['size']}"
            expected = want[kind]
            digest = _crc32(path) if kind == CRC32 else _keyed(path, secret.key(files_label))
        except (OSError, KeyError, TypeError) as e:  # unreadable, or an entry no writer made
            return f"{path} cannot be checked ({type(e).__name__}: {e})"
        if digest != expected:
            return f"{path} does not match its {'keyed hash' if kind == KEYED else 'checksum'} in {MANIFEST}"
    return None
