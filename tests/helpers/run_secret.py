"""A test process that acts as one of a run's processes (writing its data, reading what it saved)
holds the run's secret meanwhile, as that process would."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from prime_rl.runtime import secret


@contextmanager
def holding(path: Path):
    """This process's secret is the one in `path` inside the block, what it was after."""
    before = os.environ.get(secret.FILE_ENV)
    os.environ[secret.FILE_ENV] = str(path)
    secret.value.cache_clear()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(secret.FILE_ENV, None)
        else:
            os.environ[secret.FILE_ENV] = before
        secret.value.cache_clear()
