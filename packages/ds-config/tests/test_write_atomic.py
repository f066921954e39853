"""write_atomic: the old content or the new, whole; temp files never left behind."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest
from ds_config import write_atomic


def test_writes_bytes_and_text_and_replaces(tmp_path):
    path = tmp_path / "f.json"
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    write_atomic(path, "new")
    assert path.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_keeps_the_mode_of_an_existing_file_and_uses_the_umask_for_a_new_one(tmp_path):
    path = tmp_path / "f"
    path.write_text("x")
    path.chmod(0o640)
    write_atomic(path, "y")
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    fresh = tmp_path / "g"
    old = os.umask(0o027)
    try:
        write_atomic(fresh, "z")
    finally:
        os.umask(old)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o640


def test_a_failed_write_leaves_the_old_content_and_no_temp_file(tmp_path):
    path = tmp_path / "f"
    path.write_text("old")
    with pytest.raises(ValueError, match="bytes or str"):
        write_atomic(path, 3)
    with pytest.raises(ValueError, match="got list"):
        write_atomic(path, [1])  # refused before anything is written
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_a_process_killed_mid_write_leaves_the_old_file(tmp_path):
    # The writer dies after its temp file is written but before the rename: the target is untouched.
    path = tmp_path / "f"
    path.write_text("old")
    code = (f"import os, ds_config._atomic as a\n"
            f"real = os.replace\n"
            f"os.replace = lambda *_: os._exit(9)\n"
            f"a.write_atomic({str(path)!r}, b'new' * 1000)\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    assert path.read_text() == "old"


def test_the_directory_is_fsynced_after_the_rename(tmp_path, monkeypatch):
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.path.realpath(f"/proc/self/fd/{fd}")), real(fd)))
    write_atomic(tmp_path / "f", "x")
    assert synced[-1] == str(tmp_path.resolve())
    assert len(synced) == 2  # the file, then its directory
