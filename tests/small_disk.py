"""A small filesystem for disk-full tests: a tmpfs mounted at a folder (needs root and CAP_SYS_ADMIN;
the test is skipped, saying why, where it cannot be mounted)."""

import contextlib
import subprocess
import uuid
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_disk(where: Path, size: str):
    """A tmpfs of `size` (e.g. "12M") at `where`; yields a function that grows it to a new size."""
    where.mkdir(parents=True)
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", f"tmpfs-{uuid.uuid4().hex[:6]}",
                           str(where)], capture_output=True, text=True)  # fmt: skip
    if made.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root and CAP_SYS_ADMIN): {made.stderr.strip()}")

    def grow(new_size: str) -> None:
        subprocess.run(["mount", "-o", f"remount,size={new_size}", str(where)], check=True)

    try:
        yield grow
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
