"""What counts as a full disk, without mounting one: /dev/full fails every write with ENOSPC, as a
full disk does (the tmpfs tests in disk_full_test.py run whole processes on a real full disk)."""

import errno
from pathlib import Path

import pytest

from prime_rl.runtime.disk import DiskFull, writing
from prime_rl.runtime.monitor import MetricsLogger


def test_a_metrics_write_to_a_full_device_is_one_line_naming_the_file_and_the_step():
    with pytest.raises(DiskFull) as e:
        MetricsLogger(Path("/dev/full")).log(3, {"loss": 1.0})
    message = str(e.value)
    assert "/dev/full" in message and "the metrics of step 3" in message and "run the same command" in message
    assert "\n" not in message


def test_only_a_full_disk_becomes_disk_full(tmp_path):
    with pytest.raises(DiskFull, match="while writing the batch"), writing(tmp_path / "x", "the batch"):
        raise OSError(errno.ENOSPC, "No space left on device")
    # A library that wraps the errno in its own exception:
    with pytest.raises(DiskFull), writing(tmp_path / "x", "the checkpoint"):
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("checkpoint failed") from inner
    # Another I/O error on a disk with room, and an error that is not I/O at all: unchanged.
    with pytest.raises(PermissionError), writing(tmp_path / "x", "the batch"):
        raise PermissionError(errno.EACCES, "Permission denied")
    with pytest.raises(ValueError), writing(tmp_path / "x", "the batch"):
        raise ValueError("bug")
