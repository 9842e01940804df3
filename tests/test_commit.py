"""specgen.store.commit: atomic writes keep the old file or the complete new one; a full disk is one line."""

import errno
import hashlib
import os

import pytest

from specgen.store.commit import DiskFull, HashingFile, atomic_write, commit_file, content_hash, write_json_atomic


def test_a_failed_write_keeps_the_old_content_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "manifest.json"
    write_json_atomic(path, {"v": 1})

    def half_then_full(tmp):
        tmp.write_text('{"v": ')
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskFull) as error:
        atomic_write(path, half_then_full, size_hint=4096)
    message = str(error.value)
    assert "\n" not in message and f"out of disk space in {tmp_path}" in message and "4,096 bytes" in message
    assert path.read_text() == '{\n  "v": 1\n}' and not list(tmp_path.glob("*.tmp"))


def test_other_errors_pass_through_and_the_hash_is_sha256(tmp_path):
    def broken(tmp):
        raise PermissionError(errno.EACCES, "denied")

    with pytest.raises(PermissionError):
        atomic_write(tmp_path / "x", broken)
    atomic_write(tmp_path / "x", lambda tmp: tmp.write_bytes(b"abc" * 10_000_000))
    assert content_hash(tmp_path / "x") == hashlib.sha256(b"abc" * 10_000_000).hexdigest()


@pytest.mark.parametrize("background", [False, True], ids=["inline", "helper_thread"])
def test_hashing_file_checksum_equals_the_files_hash(tmp_path, background):
    path = tmp_path / "x"
    large = bytes(range(256)) * (40_000 + 3)  # ~10 MiB: written and hashed in several pieces in the background
    with HashingFile(path, background=background) as sink:
        for chunk in (b"", b"a" * 5, bytearray(b"b" * 70_000), memoryview(b"0123456789")[3:], large):
            assert sink.write(chunk) == len(chunk)
        sink.drain()
        assert sink.tell() == 5 + 70_000 + 7 + len(large)
    expected = hashlib.sha256(b"a" * 5 + b"b" * 70_000 + b"3456789" + large).hexdigest()
    assert sink.hexdigest() == content_hash(path) == expected


def test_committing_a_hard_link_to_the_file_already_in_place_leaves_no_temp_file(tmp_path):
    """Publishing the same checkpoint twice links its file to `<name>.tmp` while `<name>` is already a link to it:
    POSIX rename does nothing then, and the `.tmp` name must not be left beside the published file."""
    source, path, tmp = tmp_path / "source", tmp_path / "model.safetensors", tmp_path / "model.safetensors.tmp"
    source.write_bytes(b"weights")
    os.link(source, path)
    os.link(source, tmp)
    commit_file(tmp, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "source"]
    assert path.read_bytes() == b"weights"
