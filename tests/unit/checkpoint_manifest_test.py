"""A checkpoint's manifest, with and without a run secret: without one, its CRC-32s catch what storage
does; with one, its hashes and its own MAC are keyed by the secret, so a checkpoint that anyone
without the secret changed (its bytes, its manifest, its list of files, its folder) is refused as a
damaged one is, and so is one whose manifest is unkeyed or missing, unless the user vouches for it."""

import hashlib
import hmac
import json
import os
from pathlib import Path

import pytest

from prime_rl.runtime import layout, secret
from prime_rl.runtime.layout import DONE, MANIFEST, TRUST_UNKEYED, verify_checkpoint, write_manifest


@pytest.fixture
def use_secret(monkeypatch):
    """`use_secret(value)`: this process's run secret from now on (None: no secret)."""

    def use(value: str | None) -> None:
        monkeypatch.delenv(secret.FILE_ENV, raising=False)
        if value is None:
            monkeypatch.delenv(secret.ENV, raising=False)
        else:
            monkeypatch.setenv(secret.ENV, value)
        secret.value.cache_clear()

    monkeypatch.delenv(TRUST_UNKEYED, raising=False)
    use(None)
    yield use
    secret.value.cache_clear()


def saved(tmp_path: Path, step: int = 2) -> Path:
    """A complete checkpoint folder: shard, metadata and rank file, its manifest, then DONE."""
    folder = tmp_path / "checkpoints" / f"step_{step}"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(os.urandom(50_000))
    (folder / ".metadata").write_bytes(os.urandom(700))
    (folder / "rank_0.pt").write_bytes(os.urandom(900))
    write_manifest(folder)
    (folder / DONE).touch()
    return folder


def manifest(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def rewrite(folder: Path, content: dict) -> None:
    (folder / MANIFEST).write_text(json.dumps(content))


def tamper(path: Path) -> bytes:
    """Another process changes one byte of the file, keeping its size; returns the new bytes."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    return bytes(data)


def test_without_a_secret_crc32_catches_storage_damage_as_before(use_secret, tmp_path):
    folder = saved(tmp_path)
    assert manifest(folder)["hash"] == "crc32" and "mac" not in manifest(folder)
    assert verify_checkpoint(folder) is None
    tamper(folder / "__0_0.distcp")
    assert verify_checkpoint(folder) == f"{folder / '__0_0.distcp'} does not match its checksum in {MANIFEST}"
    (folder / "rank_0.pt").write_bytes(b"cut")
    rewrite(folder, {"files": {"rank_0.pt": manifest(folder)["files"]["rank_0.pt"]}})  # an older manifest
    assert verify_checkpoint(folder) == f"{folder / 'rank_0.pt'} is 3 bytes, its manifest says 900"
    (folder / MANIFEST).unlink()  # a checkpoint from before manifests
    assert verify_checkpoint(folder) is None


def test_with_a_secret_the_hashes_are_keyed_and_an_intact_checkpoint_verifies(use_secret, tmp_path):
    use_secret("run-secret")
    folder = saved(tmp_path)
    written = manifest(folder)
    assert written["hash"] == "hmac-sha256" and written["folder"] == "step_2" and len(written["mac"]) == 64
    key = secret.key(layout.FILES_KEY)
    for name, entry in written["files"].items():
        assert "crc32" not in entry
        assert entry["hmac-sha256"] == hmac.new(key, (folder / name).read_bytes(), hashlib.sha256).hexdigest()
    assert verify_checkpoint(folder) is None


def test_a_big_file_is_hashed_in_chunks_to_the_same_hash(use_secret, tmp_path, monkeypatch):
    monkeypatch.setattr(layout, "HASH_CHUNK", 1000)
    data = os.urandom(10_500)
    (tmp_path / "f").write_bytes(data)
    key = b"k" * 32
    assert layout._keyed(tmp_path / "f", key) == hmac.new(key, data, hashlib.sha256).hexdigest()


@pytest.mark.parametrize("manifest_too", ["untouched", "crc32 in the entry", "old-style manifest"])
def test_a_file_another_process_changed_is_refused(use_secret, tmp_path, manifest_too):
    # The attacker changes a shard and, knowing the format, fixes the manifest the only ways open
    # without the secret: a CRC-32 in place of the keyed hash, or a whole old-style CRC manifest.
    use_secret("run-secret")
    folder = saved(tmp_path)
    shard = folder / "__0_0.distcp"
    data = tamper(shard)
    written = manifest(folder)
    if manifest_too == "crc32 in the entry":
        written["files"]["__0_0.distcp"] = {"size": len(data), "crc32": f"{layout.zlib.crc32(data):08x}"}
        rewrite(folder, written)
    elif manifest_too == "old-style manifest":
        sizes = {name: (folder / name).stat().st_size for name in written["files"]}
        crcs = {name: f"{layout.zlib.crc32((folder / name).read_bytes()):08x}" for name in written["files"]}
        rewrite(folder, {"files": {name: {"size": sizes[name], "crc32": crcs[name]} for name in sizes}})
    problem = verify_checkpoint(folder)
    expected = {
        "untouched": f"{shard} does not match its keyed hash in {MANIFEST}",
        "crc32 in the entry": f"{folder / MANIFEST} does not match its MAC",
        "old-style manifest": f"{folder / MANIFEST} is not keyed by the run secret",
    }[manifest_too]
    assert problem.startswith(expected) and "\n" not in problem, problem


def test_an_entry_rehashed_with_another_key_is_refused(use_secret, tmp_path):
    use_secret("run-secret")
    folder = saved(tmp_path)
    data = tamper(folder / "rank_0.pt")
    written = manifest(folder)
    written["files"]["rank_0.pt"]["hmac-sha256"] = hmac.new(b"guess" * 8, data, hashlib.sha256).hexdigest()
    rewrite(folder, written)
    assert verify_checkpoint(folder).startswith(f"{folder / MANIFEST} does not match its MAC")


def test_a_checkpoint_saved_with_another_secret_is_refused(use_secret, tmp_path):
    use_secret("another-run")
    folder = saved(tmp_path)
    use_secret("run-secret")
    assert verify_checkpoint(folder) == (
        f"{folder / MANIFEST} does not match its MAC: changed since it was saved, or saved with another run secret"
    )


@pytest.mark.parametrize("how", ["entry dropped", "file and entry dropped", "entry renamed"])
def test_a_manifest_whose_list_of_files_was_changed_is_refused(use_secret, tmp_path, how):
    use_secret("run-secret")
    folder = saved(tmp_path)
    written = manifest(folder)
    entry = written["files"].pop("rank_0.pt")
    if how == "file and entry dropped":
        (folder / "rank_0.pt").unlink()
    elif how == "entry renamed":
        written["files"]["rank_1.pt"] = entry
        (folder / "rank_0.pt").rename(folder / "rank_1.pt")
    rewrite(folder, written)
    assert verify_checkpoint(folder).startswith(f"{folder / MANIFEST} does not match its MAC")


def test_a_file_added_to_a_keyed_checkpoint_is_refused(use_secret, tmp_path):
    # e.g. the rank file of a rank the saving run did not have, which that rank would load
    use_secret("run-secret")
    folder = saved(tmp_path)
    (folder / "rank_1.pt").write_bytes(b"planted")
    assert verify_checkpoint(folder) == (
        f"{folder / 'rank_1.pt'} is not in {MANIFEST}: added since the checkpoint was saved"
    )


def test_a_keyed_checkpoint_moved_to_another_step_is_refused(use_secret, tmp_path):
    use_secret("run-secret")
    older = saved(tmp_path, step=2)
    newest = older.parent / "step_4"
    older.rename(newest)
    assert verify_checkpoint(newest) == (
        f"{newest / MANIFEST} was saved for step_2, not step_4: the checkpoint was moved"
    )


@pytest.mark.parametrize("manifest_is", ["unkeyed", "missing"])
def test_an_unkeyed_checkpoint_under_a_secret_is_refused_unless_trusted(
    use_secret, tmp_path, monkeypatch, manifest_is
):
    folder = saved(tmp_path)  # without a secret, or by an earlier prime-rl
    if manifest_is == "missing":
        (folder / MANIFEST).unlink()
    use_secret("run-secret")
    problem = verify_checkpoint(folder)
    assert problem.startswith(
        f"{folder / MANIFEST} is {'not keyed by the run secret' if manifest_is == 'unkeyed' else 'missing'}"
    )
    assert problem.endswith(f"if you trust it, resume with {TRUST_UNKEYED}=1") and "\n" not in problem
    monkeypatch.setenv(TRUST_UNKEYED, "1")
    assert verify_checkpoint(folder) is None
    if manifest_is == "unkeyed":  # trusted, it is still checked for storage damage
        tamper(folder / "__0_0.distcp")
        assert verify_checkpoint(folder).endswith(f"does not match its checksum in {MANIFEST}")


def test_a_keyed_checkpoint_without_a_secret_says_how_to_give_it(use_secret, tmp_path):
    use_secret("run-secret")
    folder = saved(tmp_path)
    use_secret(None)
    problem = verify_checkpoint(folder)
    assert problem.startswith(f"{folder / MANIFEST} is keyed by a run secret and this process has none")
    assert f"{secret.FILE_ENV} to the run's secret file ({tmp_path / secret.FILE_NAME} when" in problem
