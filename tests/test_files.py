"""transport.files: the one way the node writes a file a crash must leave whole."""

import os
import stat

import pytest

from swarmd.transport.files import replace_durably, write_durably

pytestmark = pytest.mark.beside


def test_a_file_written_durably_holds_the_new_bytes_and_no_temporary_is_left(tmp_path):
    path = tmp_path / "f.json"
    path.write_bytes(b"old")
    (tmp_path / "f.json.tmp").write_bytes(b"a crash's leftover")
    write_durably(path, [b"ne", b"w"])  # pieces, in order
    assert path.read_bytes() == b"new" and not (tmp_path / "f.json.tmp").exists()
    write_durably(path, b"bytes")
    assert path.read_bytes() == b"bytes"


def test_a_secret_is_never_readable_by_others_even_when_a_leftover_was(tmp_path):
    path = tmp_path / "identity.key"
    leftover = tmp_path / "identity.key.tmp"
    leftover.write_bytes(b"x")
    os.chmod(leftover, 0o644)
    write_durably(path, b"secret", mode=0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() == b"secret"


def test_a_file_written_by_another_library_is_renamed_over_the_old_one(tmp_path):
    path, tmp = tmp_path / "c.safetensors", tmp_path / "c.safetensors.tmp"
    path.write_bytes(b"old")
    tmp.write_bytes(b"new")
    replace_durably(tmp, path)
    assert path.read_bytes() == b"new" and not tmp.exists()
