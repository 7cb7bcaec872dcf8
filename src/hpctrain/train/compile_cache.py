"""PyTorch's compile caches kept in the run directory, so a resumed run does not compile again.

A requeued job often lands on another node, whose ``/tmp/torchinductor_*`` is empty: it pays the
whole compilation (most of the 22-24 s start-up of a 1b run on one GPU) every time. After the
first steps have compiled, each rank saves ``torch.compiler.save_cache_artifacts()``
(inductor, AOTAutograd and Triton entries) beside the run; a later attempt loads them with
``torch.compiler.load_cache_artifacts`` before its first step::

    <run>/cache/compile-<torch version>-<key>-rank<NNNNN>.bin    the artifacts
    <run>/cache/compile-<torch version>-<key>-rank<NNNNN>.json   {"size", "xxh3", "torch", "key"}

``key`` hashes what shapes the compiled graphs (model, parallel layout, precision, batch and
sequence shape, world size, device type): another config compiles other graphs, and its
cache is never loaded.

These bytes are code: ``load_cache_artifacts`` unpickles them and the caches they fill hold
compiled kernels and pickled graphs that run. So only files this run wrote are loaded: both
files owned by this user and writable by nobody else (written 0600 while the run's lock is
held; another user cannot make a file owned by us), the record's torch version and key equal
to this process's, and the artifacts' size and xxh3 equal to the record's (a partial or
damaged write). Anything else is ignored with a warning, and the run compiles as usual.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import xxhash

from hpctrain.config import JobConfig
from hpctrain.runtime.safe_open import UnsafeRunPath, make_dir, open_read, write_atomic

log = logging.getLogger("hpctrain.compile_cache")

CACHE_DIR = "cache"


def shape_key(shape: dict[str, Any]) -> str:
    """A short hash of what determines the compiled graphs (a JSON-able dict)."""
    text = json.dumps(shape, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_compile_cache(cfg: JobConfig, run_root: Path, world_size: int, rank: int,
                      device: torch.device) -> CompileCache | None:
    """A rank's compile cache for a training run, or None when nothing is compiled."""
    if not cfg.parallel.compile:
        return None
    shape = {"model": asdict(cfg.model), "parallel": asdict(cfg.parallel),
             "precision": cfg.train.precision, "micro_batch": cfg.train.micro_batch,
             "grad_accum": cfg.train.grad_accum, "seq_len": cfg.data.seq_len,
             "loss_chunks": cfg.train.loss_chunks, "task": cfg.task, "world_size": world_size,
             "device": device.type}
    return CompileCache(run_root, shape, rank)


class CompileCache:
    """One rank's compile-cache files in a run directory."""

    def __init__(self, run_root: Path, shape: dict[str, Any], rank: int):
        self.folder = run_root / CACHE_DIR
        self.key = shape_key(shape)
        stem = f"compile-{torch.__version__}-{self.key}-rank{rank:05d}"
        self.data = self.folder / f"{stem}.bin"
        self.record = self.folder / f"{stem}.json"
        self.loaded = False

    def load(self) -> bool:
        """Load the artifacts a previous attempt of this run saved (before anything compiles);
        False, with a warning naming why, when there are none usable."""
        if not self.data.exists() and not self.record.exists():
            return False
        try:
            record = json.loads(self._own(self.record).decode("utf-8"))
            data = self._own(self.data)
        except (OSError, ValueError, UnsafeRunPath) as e:
            return self._ignored(f"{type(e).__name__}: {e}")
        if not isinstance(record, dict):
            return self._ignored(f"{self.record.name} is not a record")
        if record.get("torch") != torch.__version__:
            return self._ignored(f"written by torch {record.get('torch')!r}, this is torch "
                                 f"{torch.__version__}")
        if record.get("key") != self.key:
            return self._ignored("written for another model or layout")
        if record.get("size") != len(data) or record.get("xxh3") != _xxh3(data):
            return self._ignored(f"{self.data.name} does not match its record (a partial or "
                                 "damaged write)")
        try:
            info = torch.compiler.load_cache_artifacts(data)
        except Exception as e:  # noqa: BLE001 - a cache that cannot be used costs a compile
            return self._ignored(f"torch could not load it: {type(e).__name__}: {e}")
        self.loaded = info is not None
        if self.loaded:
            log.info("compile cache loaded from %s (%.1f MB)", self.data, len(data) / 1e6)
        return self.loaded

    def save(self) -> bool:
        """Save what this process compiled so far (after the first steps); False if nothing
        was compiled or a usable cache was loaded already."""
        if self.loaded:
            return False
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts is None:
            return False
        data = artifacts[0]
        try:
            make_dir(self.folder)
            # The record last: a record names only artifacts that are completely written.
            self.record.unlink(missing_ok=True)
            _write_private(self.data, data)
            _write_private(self.record, json.dumps({
                "size": len(data), "xxh3": _xxh3(data), "torch": torch.__version__,
                "key": self.key}).encode())
        except (OSError, UnsafeRunPath) as e:
            log.warning("compile cache not saved to %s: %s (a resumed run compiles again)",
                        self.folder, e)
            return False
        log.info("compile cache saved to %s (%.1f MB)", self.data, len(data) / 1e6)
        return True

    def _own(self, path: Path) -> bytes:
        """The bytes of a file only this user can have written (see the module docstring)."""
        with open_read(path) as f:  # never through a link; the checks are of what is read
            info = os.fstat(f.fileno())
            if info.st_uid != os.geteuid():
                raise UnsafeRunPath(f"{path} belongs to another user")
            if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                raise UnsafeRunPath(f"{path} is writable by others")
            return f.read()

    def _ignored(self, why: str) -> bool:
        log.warning("compile cache %s ignored: %s; compiling from scratch", self.data, why)
        return False


def _xxh3(data: bytes) -> str:
    return xxhash.xxh3_64(data).hexdigest()


def _write_private(path: Path, data: bytes) -> None:
    """Write atomically, then make the file owner-only (whatever the umask says)."""
    write_atomic(path, data)
    with open_read(path) as f:
        os.fchmod(f.fileno(), 0o600)
