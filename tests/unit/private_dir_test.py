"""The folder vLLM keeps its IPC sockets in (its TMPDIR) is this user's alone: made 0700, reused
across the run's starts, and refused when someone else could have made it or may write to it."""

import os
import shutil
import stat
import tempfile
from pathlib import Path

import pytest

from prime_rl.engine.server import UnsafeFolder, private_dir, server_env
from prime_rl.inference.config import InferenceConfig


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_a_long_run_path_gets_a_private_socket_folder_in_the_temp_folder(tmp_path, monkeypatch):
    system_tmp = tmp_path / "tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))  # the system's temp folder, for this test
    config = InferenceConfig(output_dir=tmp_path / ("deep-" * 12) / "run")
    folder = Path(server_env(config, base={})["TMPDIR"])
    assert folder.parent == system_tmp and folder.name.startswith("prime-rl-")
    assert mode(folder) == 0o700 and folder.stat().st_uid == os.geteuid()
    assert server_env(config, base={})["TMPDIR"] == str(folder)  # a restart of the run takes it again
    # vLLM names its sockets from this, not from TMPDIR, in a process that has looked up its temp
    # folder before (the orchestrator, in engine mode)
    assert server_env(config, base={})["VLLM_RPC_BASE_PATH"] == str(folder)


def test_the_long_paths_socket_folder_cannot_be_made_first_by_someone_else(tmp_path, monkeypatch):
    # Its name was a digest of the run's path: another user who made that folder first (or a link
    # there) stopped the run. Now it is random, made by `mkdtemp`; a kept name that is no longer
    # ours and private is replaced, not refused.
    import hashlib

    system_tmp = tmp_path / "tmp"
    system_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(system_tmp))
    config = InferenceConfig(output_dir=tmp_path / ("deep-" * 12) / "run")
    run_dir = (tmp_path / ("deep-" * 12) / "run").resolve() / "inference"
    old_name = system_tmp / f"prime-rl-{hashlib.sha1(str(run_dir / 'tmp').encode()).hexdigest()[:12]}"
    old_name.mkdir(mode=0o777)
    old_name.chmod(0o777)  # a neighbour's squat under the name it used to have
    first = Path(server_env(config, base={})["TMPDIR"])
    assert first != old_name and mode(first) == 0o700
    first.chmod(0o777)  # the kept folder is no longer private (someone changed it)
    second = Path(server_env(config, base={})["TMPDIR"])
    assert second != first and mode(second) == 0o700


def test_a_short_run_path_keeps_its_socket_folder_in_the_run_and_private(tmp_path):
    out = Path(tempfile.mkdtemp(dir="/tmp", prefix="r"))  # short enough for the sockets
    try:
        folder = Path(server_env(InferenceConfig(output_dir=out), base={})["TMPDIR"])
        assert folder == out.resolve() / "inference" / "tmp" and mode(folder) == 0o700
    finally:
        shutil.rmtree(out)


def test_a_socket_folder_others_may_write_to_or_that_is_a_link_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(UnsafeFolder, match=f"{shared} is writable by others"):
        private_dir(shared)
    link = tmp_path / "link"
    link.symlink_to(shared)
    with pytest.raises(UnsafeFolder, match="is a link"):
        private_dir(link)
    (tmp_path / "file").write_text("")
    with pytest.raises(UnsafeFolder, match="is not a folder"):
        private_dir(tmp_path / "file")


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder of another user's needs root")
def test_a_socket_folder_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(UnsafeFolder, match="owned by uid 65534"):
        private_dir(theirs)


def test_an_own_folder_nobody_else_may_write_to_is_narrowed_to_0700(tmp_path):
    # (As an earlier version left it: 0755 under the usual umask.)
    ours = tmp_path / "ours"
    ours.mkdir()
    ours.chmod(0o755)
    assert private_dir(ours) == ours and mode(ours) == 0o700
