"""The manifest that makes a checkpoint trustworthy: sizes and xxh3 checksums, and their checks.

Pure file-level tests (no torch.distributed): every damage a file system can do to a committed
checkpoint — a short write, a flipped bit, a lost file, a broken manifest — is named precisely.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import xxhash

from hpctrain.checkpoint.manifest import (
    FORMAT_VERSION,
    MANIFEST,
    CheckpointError,
    checksum,
    describe,
    read_manifest,
    verify_files,
    write_manifest,
)


@pytest.fixture()
def ckpt(tmp_path: Path) -> tuple[Path, dict]:
    """A checkpoint-like directory of three files and its manifest."""
    d = tmp_path / "step-00000003"
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 40)
    (d / "__1_0.distcp").write_bytes(b"\x07" * 5000)
    (d / ".metadata").write_bytes(b"index")
    files = {p.name: describe(p) for p in d.iterdir()}
    write_manifest(d, files, {"step": 3, "world_size": 2})
    return d, files


def test_checksum_is_xxh3_of_the_bytes(tmp_path: Path) -> None:
    """Also across the reader's 8 MiB chunk boundary (the hash is streamed)."""
    data = bytes(range(256)) * ((8 << 20) // 256 + 3)
    f = tmp_path / "big"
    f.write_bytes(data)
    assert checksum(f) == xxhash.xxh3_64(data).hexdigest()
    assert describe(f) == {"size": len(data), "xxh3": xxhash.xxh3_64(data).hexdigest()}
    g = tmp_path / "other"
    g.write_bytes(data[:-1] + b"\x00")
    assert checksum(g) != checksum(f)


def test_manifest_round_trip(ckpt: tuple[Path, dict]) -> None:
    d, files = ckpt
    m = read_manifest(d)
    assert m["format_version"] == FORMAT_VERSION
    assert m["files"] == files
    assert m["step"] == 3 and m["world_size"] == 2
    verify_files(d, m["files"], sorted(m["files"]))  # intact: no error


def test_truncated_file_is_named_with_both_sizes(ckpt: tuple[Path, dict]) -> None:
    d, files = ckpt
    shard = d / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1234])
    with pytest.raises(CheckpointError) as e:
        verify_files(d, files, sorted(files))
    msg = e.value.what
    assert str(shard) in msg
    assert "1234 bytes" in msg and "5000" in msg, msg


def test_flipped_byte_is_a_checksum_mismatch(ckpt: tuple[Path, dict]) -> None:
    """Same size, one byte changed: only the checksum can tell."""
    d, files = ckpt
    shard = d / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[4321] ^= 0x01
    shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as e:
        verify_files(d, files, sorted(files))
    msg = e.value.what
    assert str(shard) in msg and "checksum" in msg, msg
    assert files["__0_0.distcp"]["xxh3"] in msg


def test_missing_file_is_named(ckpt: tuple[Path, dict]) -> None:
    d, files = ckpt
    (d / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="missing") as e:
        verify_files(d, files, sorted(files))
    assert str(d / ".metadata") in e.value.what


def test_verify_checks_only_the_names_given(ckpt: tuple[Path, dict]) -> None:
    """Ranks split the files between them; a rank is not blamed for another's file."""
    d, files = ckpt
    (d / "__1_0.distcp").write_bytes(b"")
    verify_files(d, files, ["__0_0.distcp", ".metadata"])
    with pytest.raises(CheckpointError, match="__1_0.distcp"):
        verify_files(d, files, ["__1_0.distcp"])


def test_read_manifest_missing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="missing") as e:
        read_manifest(tmp_path)
    assert str(tmp_path / MANIFEST) in e.value.what


def test_read_manifest_bad_json(ckpt: tuple[Path, dict]) -> None:
    d, _ = ckpt
    (d / MANIFEST).write_text('{"format_version": 1, "files": {')  # cut short
    with pytest.raises(CheckpointError, match="unreadable") as e:
        read_manifest(d)
    assert str(d / MANIFEST) in e.value.what


@pytest.mark.parametrize("content, field, expected", [
    ({"format_version": FORMAT_VERSION + 1, "files": {}}, "format_version", str(FORMAT_VERSION)),
    ({"format_version": None, "files": {}}, "format_version", str(FORMAT_VERSION)),
    ({"format_version": FORMAT_VERSION}, "files = (missing)", "size, xxh3"),  # no file list
])
def test_read_manifest_wrong_version_or_shape(ckpt: tuple[Path, dict], content: dict,
                                              field: str, expected: str) -> None:
    d, _ = ckpt
    (d / MANIFEST).write_text(json.dumps(content))
    with pytest.raises(CheckpointError, match=re.escape(field)) as e:
        read_manifest(d)
    assert str(d / MANIFEST) in e.value.what
    assert e.value.expected and expected in e.value.expected
