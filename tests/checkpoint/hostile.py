"""Hostile checkpoint files, as someone who can write to a shared checkpoint folder makes them.

Each payload, when unpickled by a trusting reader, creates a marker file: the tests assert the
marker does not exist after hpctrain read the checkpoint, and prove each payload is live by
running it through a plain unpickler. The manifest is rewritten with the new sizes and xxh3
checksums, as an attacker would (the manifest has no key), so only the loader stands between
the payload and code execution.

Loaded by path from ``tests/security`` and ``tests/train`` (the test folders are not packages).
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from hpctrain.checkpoint.manifest import describe, read_manifest, write_manifest
from hpctrain.checkpoint.safe_io import SafeFileSystemReader


class ShellPayload:
    """``__reduce__`` to ``os.system``: unpickling runs a shell command."""

    target = os.system

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class PopenPayload:
    """``__reduce__`` to ``subprocess.Popen``: unpickling starts a process."""

    target = subprocess.Popen

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (subprocess.Popen, (["touch", str(self.marker)],))


class EvalPayload:
    """``__reduce__`` to ``builtins.eval``: unpickling evaluates Python code."""

    target = builtins.eval

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (builtins.eval, (f"open({str(self.marker)!r}, 'w').close()",))


PAYLOADS = {"os.system": ShellPayload, "subprocess.Popen": PopenPayload,
            "builtins.eval": EvalPayload}


def refused_name(payload_cls: type) -> str:
    """The global a loader must name when it refuses ``payload_cls`` (``posix.system``...)."""
    fn = payload_cls.target
    return f"{fn.__module__}.{fn.__qualname__}"


def _short_str(s: str) -> bytes:
    raw = s.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw


def dotted_global_pickle(module: str, qualname: str, arg: str) -> bytes:
    """Protocol 4: ``module`` + a dotted ``qualname`` (``os.system`` reached through a module
    that imports ``os``), called with ``arg``. A module-only allow-list lets this through."""
    return (pickle.PROTO + b"\x04" + _short_str(module) + _short_str(qualname)
            + pickle.STACK_GLOBAL + _short_str(arg) + pickle.TUPLE1 + pickle.REDUCE
            + pickle.STOP)


def wait_for(marker: Path, timeout: float = 10.0) -> bool:
    """Whether ``marker`` appears within ``timeout`` s (a Popen payload runs asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker.exists():
            return True
        time.sleep(0.02)
    return marker.exists()


def settle() -> None:
    """Give an asynchronous payload (Popen) time to act before asserting that nothing ran."""
    time.sleep(0.5)


def reseal(ckpt: Path, *names: str) -> None:
    """Rewrite the manifest's size and xxh3 of ``names`` (what an attacker can do)."""
    manifest = read_manifest(ckpt)
    files = dict(manifest.pop("files"))
    manifest.pop("format_version")
    for name in names:
        files[name] = describe(ckpt / name)
    write_manifest(ckpt, files, manifest)


def write_resealed(ckpt: Path, name: str, data: bytes) -> None:
    """Replace one file of a committed checkpoint and reseal the manifest."""
    (ckpt / name).write_bytes(data)
    reseal(ckpt, name)


def read_index(ckpt: Path) -> Any:
    """The genuine DCP metadata of a checkpoint written by the test itself."""
    return SafeFileSystemReader(ckpt).read_metadata()


def nested_metadata_pickle(ckpt: Path, payload: object) -> bytes:
    """The checkpoint's own, valid Metadata with ``payload`` hidden in ``planner_data``."""
    metadata = read_index(ckpt)
    metadata.storage_meta.load_id = None
    metadata.planner_data = {**(metadata.planner_data or {}), "hidden": payload}
    return pickle.dumps(metadata)


def torch_pickle(obj: object) -> bytes:
    """``obj`` as ``torch.save`` writes it (the format of DCP items and RNG files)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def item_named(ckpt: Path, suffix: str) -> str:
    """The first state-dict entry of a checkpoint whose name ends with ``suffix``."""
    return next(idx.fqn for idx in read_index(ckpt).storage_data if idx.fqn.endswith(suffix))


def replace_item(ckpt: Path, fqn: str, data: bytes) -> str:
    """Replace the stored bytes of state-dict entry ``fqn`` in its ``.distcp`` shard.

    The shard is rebuilt with every later item moved, the index rewritten with the new offsets
    (it still holds only DCP's own classes), and both resealed. Returns the shard's name.
    """
    metadata = read_index(ckpt)
    metadata.storage_meta.load_id = None
    storage = metadata.storage_data
    target = next(idx for idx in storage if idx.fqn == fqn)
    shard = storage[target].relative_path
    items = sorted((idx for idx in storage if storage[idx].relative_path == shard),
                   key=lambda idx: storage[idx].offset)
    old = (ckpt / shard).read_bytes()
    out = bytearray()
    for idx in items:
        info = storage[idx]
        chunk = data if idx == target else old[info.offset:info.offset + info.length]
        info.offset, info.length = len(out), len(chunk)
        out += chunk
    (ckpt / shard).write_bytes(bytes(out))
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(ckpt, shard, ".metadata")
    return shard
