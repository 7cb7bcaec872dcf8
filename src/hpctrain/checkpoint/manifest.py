"""The manifest that makes a checkpoint trustworthy: every file's size and xxh3 checksum.

A checkpoint directory is only ever renamed into place after its manifest is written, so a
directory named ``step-*`` without a manifest that verifies is a damaged one, never a partial
write in progress.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import xxhash

from hpctrain.errors import HpctrainError
from hpctrain.runtime.rundir import write_json_atomic

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_CHUNK = 8 << 20


class CheckpointError(HpctrainError):
    """A checkpoint is missing, damaged, or could not be written."""

    exit_code = 1


def checksum(path: Path) -> str:
    """xxh3-64 of a file's bytes, hex (fast enough to hash GBs per second per core)."""
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def describe(path: Path) -> dict[str, Any]:
    """Size and checksum of one file, as the manifest records it."""
    return {"size": path.stat().st_size, "xxh3": checksum(path)}


def write_manifest(ckpt_dir: Path, files: dict[str, dict[str, Any]], meta: dict) -> None:
    """Write ``manifest.json`` (atomically) listing ``files`` and the trainer's ``meta``."""
    write_json_atomic(ckpt_dir / MANIFEST,
                      {"format_version": FORMAT_VERSION, "files": files, **meta})


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """The parsed manifest, or CheckpointError naming what is wrong with it."""
    path = ckpt_dir / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (the save never committed)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path} is unreadable: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} holds a JSON {type(data).__name__}, not a manifest")
    if data.get("format_version") != FORMAT_VERSION or "files" not in data:
        raise CheckpointError(f"{path} has format {data.get('format_version')!r}",
                              expected=f"format_version {FORMAT_VERSION} with a file list")
    return data


def verify_files(ckpt_dir: Path, files: dict[str, dict[str, Any]], names: list[str]) -> None:
    """Check size and checksum of ``names``; raise CheckpointError naming the first bad file."""
    for name in names:
        path = ckpt_dir / name
        want = files[name]
        if not path.is_file():
            raise CheckpointError(f"{path} is missing")
        size = path.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"{path} is {size} bytes, the manifest says {want['size']} "
                                  "(truncated or overwritten)")
        got = checksum(path)
        if got != want["xxh3"]:
            raise CheckpointError(f"{path} checksum {got} does not match the manifest's "
                                  f"{want['xxh3']} (corrupted)")
