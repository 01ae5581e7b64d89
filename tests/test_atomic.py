import os
import stat

import pytest

from cachetune.atomic import write_text_atomic


def test_atomic_write_replaces_the_file_with_umask_permissions(tmp_path):
    path = tmp_path / "sub" / "report.json"
    old = os.umask(0o022)
    try:
        write_text_atomic(path, "old")
        write_text_atomic(path, "new")
    finally:
        os.umask(old)
    assert path.read_text() == "new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # as open() would create it, not mkstemp's 0o600
    assert sorted(p.name for p in path.parent.iterdir()) == ["report.json"]


def test_a_failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "calibration.json"
    write_text_atomic(path, "kept")
    with pytest.raises(TypeError):
        write_text_atomic(path, b"not text")  # fails inside the write
    assert path.read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["calibration.json"]
