"""Out of disk space: one line that names the path and what was being written, never a traceback.

Invariant: the writers of a run's output (weights, checkpoints, batches, progress, rollouts,
metrics, logs) write inside `writing(path, what)`; a failure there that is a full disk (errno
ENOSPC or EDQUOT anywhere in the exception's chain, or, for libraries that hide the errno such as
torch's checkpoint writers, an I/O failure while less than `LOW_BYTES` are left where `path`
lives) becomes `DiskFull`.
Everything else passes through unchanged. Writers mark a file or folder complete last (atomic
rename, `DONE`, `READY`), so what a full disk cut short is never taken for complete: once space is
freed, the same command resumes.
"""

from __future__ import annotations

import contextlib
import errno
import shutil
from collections.abc import Iterator
from pathlib import Path

LOW_BYTES = 16 * 2**20
"""Free space under which a failed write counts as a full disk even without an errno."""

_FULL = {errno.ENOSPC, errno.EDQUOT}


class DiskFull(RuntimeError):
    """A write failed because the disk (or quota) holding the run's output is full."""


def free_bytes(path: Path) -> int | None:
    """Free space on the filesystem holding `path` (its nearest existing parent); None if unknown."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _a_write(x: BaseException) -> bool:
    """An I/O failure, possibly wrapped: an OSError, torch's CheckpointException (which carries the
    ranks' errors as text), or a writer's RuntimeError about a write."""
    return (
        isinstance(x, OSError)
        or type(x).__name__ == "CheckpointException"
        or (isinstance(x, RuntimeError) and "writ" in str(x).lower())
    )


def is_disk_full(e: BaseException, path: Path) -> bool:
    chain = list(_chain(e))
    for x in chain:
        if isinstance(x, OSError) and x.errno in _FULL:
            return True
        if "No space left on device" in str(x) or "Disk quota exceeded" in str(x):
            return True
    if not any(_a_write(x) for x in chain):
        return False  # e.g. a peer rank's crash inside a checkpoint save: not a full disk
    free = free_bytes(path)
    return free is not None and free < LOW_BYTES


def disk_full(path: Path, what: str) -> DiskFull:
    free = free_bytes(path)
    left = f"{free / 2**20:.1f} MB free" if free is not None else "free space unknown"
    return DiskFull(
        f"no space left on the disk holding {path} while writing {what} ({left}); free space there "
        "and run the same command again: it resumes from what was complete"
    )


@contextlib.contextmanager
def writing(path: Path, what: str) -> Iterator[None]:
    """Turn a full disk while writing `what` to `path` into `DiskFull` (one line, path and what)."""
    try:
        yield
    except (DiskFull, KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException
        if is_disk_full(e, path):
            raise disk_full(path, what) from None
        raise
