"""PyTorch's compile caches kept in the run directory, so a resumed run does not compile again.

A requeued job often lands on another node, whose ``/tmp/torchinductor_*`` is empty: it pays the
whole compilation (most of the 22-24 s start-up of a 1b run on one GPU) every time. After the
first steps have compiled, each rank saves ``torch.compiler.save_cache_artifacts()``
(inductor, AOTAutograd and Triton entries) beside the run; a later attempt loads them with
``torch.compiler.load_cache_artifacts`` before its first step::

    <run>/cache/compile-<torch version>-<key>-rank<NNNNN>.bin    the artifacts
    <run>/cache/compile-<torch version>-<key>-rank<NNNNN>.json   {"size", "hmac", "torch", "key"}

``key`` hashes what shapes the compiled graphs (model, parallel layout, precision, batch and
sequence shape, world size, device type): another config compiles other graphs, and its
cache is never loaded.

These bytes are code: ``load_cache_artifacts`` unpickles them and the caches they fill hold
compiled kernels and pickled graphs that run. So only files this user's hpctrain wrote are
loaded: both files owned by this user and writable by nobody else (created 0600, never wider
for a moment, while the run's lock is held), the record's torch version and key equal to this
process's, and the artifacts' size and HMAC-SHA256 equal to the record's. The HMAC's key is
this user's, kept outside every run directory (``$XDG_CONFIG_HOME/hpctrain/compile-cache.key``,
else ``~/.config/hpctrain/compile-cache.key``, 0600): owning the files is not enough, since
whoever copies a colleague's run directory owns the copies, but a cache authenticated with
the colleague's key fails ours. Anything else is ignored with a warning, and the run compiles
as usual.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import secrets
import stat
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from hpctrain.config import JobConfig
from hpctrain.runtime.safe_open import UnsafeRunPath, make_dir, open_read, write_atomic

log = logging.getLogger("hpctrain.compile_cache")

CACHE_DIR = "cache"
KEY_BYTES = 32


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
        if record.get("size") != len(data):
            return self._ignored(f"{self.data.name} does not match its record (a partial or "
                                 "damaged write)")
        try:
            mac = _hmac(data)
        except (OSError, UnsafeRunPath) as e:
            return self._ignored(f"no cache key to check it with: {e}")
        if not hmac.compare_digest(str(record.get("hmac")), mac):
            return self._ignored(f"{self.data.name} does not match its record's HMAC (damaged, "
                                 "or written under another user's key, e.g. a copied run "
                                 "directory)")
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
            mac = _hmac(data)
            make_dir(self.folder)
            # The record last: a record names only artifacts that are completely written.
            self.record.unlink(missing_ok=True)
            write_atomic(self.data, data, mode=0o600)
            write_atomic(self.record, json.dumps({
                "size": len(data), "hmac": mac, "torch": torch.__version__,
                "key": self.key}).encode(), mode=0o600)
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


def key_path() -> Path:
    """Where this user's compile-cache key lives: in their config folder, outside any run."""
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "hpctrain" / "compile-cache.key"


def _hmac(data: bytes) -> str:
    return hmac.new(_user_key(), data, hashlib.sha256).hexdigest()


def _user_key() -> bytes:
    """This user's key, made on first use; UnsafeRunPath if it is a link, not ours or not
    0600 (a key others can read lets them forge caches we load)."""
    path = key_path()
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Made whole under a random name (O_EXCL, 0600), then linked in: os.link never replaces,
    # so ranks racing to make it all end up with the one key that won.
    tmp = path.parent / f".{path.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(KEY_BYTES))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path, follow_symlinks=False)
    finally:
        os.unlink(tmp)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    try:
        # O_NONBLOCK: a FIFO planted there would block the open until someone writes it.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeRunPath(f"the compile-cache key {path} is a symbolic link",
                                hint="remove it; hpctrain makes a new one") from None
        raise
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        why = ("not a regular file" if not stat.S_ISREG(info.st_mode)
               else "owned by another user" if info.st_uid != os.geteuid()
               else "readable or writable by others" if info.st_mode & 0o077 else None)
        key = f.read() if why is None else b""
    if why is None and len(key) != KEY_BYTES:
        why = f"{len(key)} bytes long, not {KEY_BYTES}"
    if why is not None:
        raise UnsafeRunPath(f"the compile-cache key {path} is {why}",
                            hint=f"remove it (hpctrain makes a new one) and keep "
                                 f"{path.parent} private (chmod 700)")
    return key
