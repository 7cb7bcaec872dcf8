"""Samples that are not text: tar shards readable by WebDataset, in the loader's global order.

    hpctrain data pack images/ --out data/images --shard-mb 256

``pack`` groups the files of a directory tree by key, WebDataset's way: ``a/x.jpg`` and
``a/x.json`` are sample ``a/x`` with fields ``jpg`` and ``json`` (the key ends at the basename's
first dot). Files are found as `hpctrain.data.inputs` says (no links out of the tree unless
``follow_symlinks``, no FIFOs or devices). Samples are sorted by key and written into
``shard-NNNNNN.tar`` files of about the target size, each member with fixed metadata (mtime 0,
uid 0, mode 0644), so the same input gives byte-identical shards.
``webdataset.WebDataset("data/images/shard-{000000..000003}.tar")`` reads them;
``manifest.json`` lists per shard its sample count, size and SHA-256, and each
``shard-NNNNNN.idx.json`` the byte range of every member, so `TarSamples` can read any sample of
a shard directly.

`TarSamples` gives the same guarantees as the token loader: `GlobalOrderSampler` orders the
samples as a pure function of (seed, epoch, manifest), shuffling within windows of shards; each
rank takes its slice of every global batch; `SampleLoader`'s state is the step count.

    ds = TarSamples("data/images", decode=lambda s: (Image.open(io.BytesIO(s["jpg"])), s["cls"]))
    sampler = GlobalOrderSampler(len(ds), BatchLayout(32, 1, world, rank), seed)
    loader = SampleLoader(ds, sampler)
    for micro_batch in loader.next_step(): ...   # lists of decoded samples
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.data.inputs import InputFile, walk_tree
from hpctrain.data.shards import atomic_write_json, file_checksum, make_out_dir
from hpctrain.errors import DataError
from hpctrain.runtime.rundir import fsync_dir

TAR_FORMAT = "hpctrain-tar"
TAR_VERSION = 1
MANIFEST = "manifest.json"
_TAR_FILE = re.compile(r"shard-\d{6,}\.tar")
_IDX_FILE = re.compile(r"shard-\d{6,}\.idx\.json")
PACK_HINT = "run `hpctrain data pack DIR --out OUT` and point the dataset at OUT"
# WebDataset's split of a member name into key and extension.
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")

Sample = dict[str, bytes]
Decode = Callable[[Sample], Any]


def _group(src: Path, exclude: Path, follow_symlinks: bool) -> dict[str, dict[str, InputFile]]:
    """key -> {extension: file} for every regular, non-hidden file under ``src``."""
    samples: dict[str, dict[str, InputFile]] = {}
    for rel, f in walk_tree(src, follow_symlinks=follow_symlinks, exclude={exclude}):
        m = _KEY_EXT.match(rel)
        if m is None:
            raise DataError(f"{str(f.path)!r} has no extension, so it belongs to no sample",
                            expected="files named KEY.EXT (x.jpg, x.json, x.cls)",
                            hint="rename it or move it out of the directory")
        samples.setdefault(m.group(1), {})[m.group(2)] = f
    return samples


def tar_member(name: str, size: int) -> tarfile.TarInfo:
    """A tar header with fixed metadata (mtime 0, uid 0, mode 0644): byte-identical shards."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _write_tar(out: Path, index: int, batch: list[tuple[str, dict[str, InputFile]]]) -> dict:
    stem = f"shard-{index:06d}"
    tmp = out / f"{stem}.tar.tmp"
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as tar:
        for key, fields in batch:
            for ext in sorted(fields):
                try:
                    with fields[ext].open() as f:
                        data = f.read()
                except OSError as e:
                    raise DataError(f"cannot read input {str(fields[ext].path)!r}: "
                                    f"{e.strerror}") from None
                tar.addfile(tar_member(f"{key}.{ext}", len(data)), io.BytesIO(data))
    return finish_tar(out, stem, [k for k, _ in batch])


def finish_tar(out: Path, stem: str, keys: list[str]) -> dict:
    """Commit ``out/<stem>.tar.tmp`` as ``<stem>.tar`` and write its index; its manifest entry."""
    tmp = out / f"{stem}.tar.tmp"
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, out / f"{stem}.tar")
    # Byte ranges of each sample's members, read back from the tar as written.
    members: dict[str, list] = {}
    with tarfile.open(out / f"{stem}.tar") as tar:
        for info in tar:
            key, ext = _KEY_EXT.match(info.name).groups()
            members.setdefault(key, []).append([ext, info.offset_data, info.size])
    atomic_write_json(out / f"{stem}.idx.json",
                      {"keys": keys, "members": [members[k] for k in keys]})
    return {"tar": f"{stem}.tar", "idx": f"{stem}.idx.json", "samples": len(keys),
            "bytes": (out / f"{stem}.tar").stat().st_size,
            "checksum": file_checksum(out / f"{stem}.tar"),
            "idx_checksum": file_checksum(out / f"{stem}.idx.json")}


def pack(src: str | Path, out: str | Path, shard_bytes: int = 256 << 20,
         follow_symlinks: bool = False) -> Path:
    """Pack ``src``'s files, grouped by key, into tar shards in ``out``; return the manifest."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise DataError(f"{str(src)!r} is not a directory", hint=PACK_HINT)
    if shard_bytes < 1:
        raise DataError(f"shard size {shard_bytes} bytes must be >= 1")
    make_out_dir(out)
    samples = _group(src, out.resolve(), follow_symlinks)
    if not samples:
        raise DataError(f"{str(src)!r} holds no files to pack", hint=PACK_HINT)
    shards, batch, size = [], [], 0
    for key in sorted(samples):
        fields = samples[key]
        nbytes = sum(512 + -(-f.size // 512) * 512 for f in fields.values())
        if batch and size + nbytes > shard_bytes:
            shards.append(_write_tar(out, len(shards), batch))
            batch, size = [], 0
        batch.append((key, fields))
        size += nbytes
    shards.append(_write_tar(out, len(shards), batch))
    manifest = {"format": TAR_FORMAT, "version": TAR_VERSION, "source": str(src),
                "samples": sum(s["samples"] for s in shards), "shards": shards}
    atomic_write_json(out / MANIFEST, manifest)
    fsync_dir(out)
    return out / MANIFEST


def load_tar_manifest(root: str | Path) -> dict:
    """``root/manifest.json`` of a packed directory."""
    path = Path(root) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {str(path)!r}: {e}", hint=PACK_HINT) from None
    if raw.get("format") != TAR_FORMAT or raw.get("version") != TAR_VERSION:
        raise DataError(f"{str(path)!r} is not a version-{TAR_VERSION} hpctrain tar manifest",
                        hint=PACK_HINT)
    shards = raw.get("shards")
    if not isinstance(shards, list):
        raise DataError(f"{str(path)!r} has no shard list", hint=PACK_HINT)
    for s in shards:
        # Only the names pack writes: "../x" or "/etc/x" would make a reader (or a copy) reach
        # files outside the packed directory.
        names = (s.get("tar"), s.get("idx")) if isinstance(s, dict) else (None, None)
        if not (isinstance(names[0], str) and _TAR_FILE.fullmatch(names[0])
                and isinstance(names[1], str) and _IDX_FILE.fullmatch(names[1])
                and isinstance(s.get("samples"), int) and s["samples"] >= 0):
            raise DataError(f"{str(path)!r} has a malformed shard entry (files {names!r})",
                            expected="shard-NNNNNN.tar and shard-NNNNNN.idx.json in the same "
                            "directory, a sample count >= 0", hint=PACK_HINT)
    return raw


def verify_tar(root: str | Path) -> dict:
    """Recompute every shard's checksum; raise DataError naming the first mismatch."""
    root = Path(root)
    raw = load_tar_manifest(root)
    for s in raw["shards"]:
        for name, want in ((s["tar"], s["checksum"]), (s["idx"], s["idx_checksum"])):
            path = root / name
            if not path.is_file():
                raise DataError(f"shard file {str(path)!r} listed in the manifest is missing")
            got = file_checksum(path)
            if got != want:
                raise DataError(f"checksum mismatch in shard {str(path)!r}: manifest has {want}, "
                                f"file has {got}", hint="pack the data again")
    return raw


class TarSamples:
    """Sample ``i`` of a packed directory (shards in order), read directly from its tar.

    Shard files are opened on first read by each process and never pickled: a DataLoader
    worker started by spawn (or Lightning's) opens its own, and a forked child leaves the
    parent's alone (a descriptor number from another process would read some other file).

    Safe from several threads: a lock covers finding a sample's shard and reading its bytes,
    so a shard closed to make room (another thread's read) is never one being read, and its
    descriptor number, reused by the next open, never reads another file. Decoding runs
    outside the lock."""

    # A window's worth of shards stays open (the oldest opened is closed first).
    open_shards = 8

    def __init__(self, root: str | Path, decode: Decode | None = None, window_shards: int = 4):
        self.root = Path(root)
        self.raw = load_tar_manifest(self.root)
        self.decode = decode
        # Read by the sampler hooks: shuffle within windows of this many shards.
        self.window_shards = window_shards
        self.shard_sample_counts = np.array([s["samples"] for s in self.raw["shards"]],
                                            dtype=np.int64)
        self._starts = np.concatenate([[0], np.cumsum(self.shard_sample_counts)])
        self._index: dict[int, dict] = {}
        self._fds: dict[int, int] = {}
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        """Pickled without the open shard files (the copy opens its own) and the lock."""
        return {**self.__dict__, "_index": {}, "_fds": {}, "_lock": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _shard_index(self, s: int) -> dict:
        """Shard ``s``'s index, its file open in ``_fds`` (called with the lock held)."""
        if self._pid != os.getpid():  # a forked child: its copies of the parent's descriptors
            self._close()
            self._pid = os.getpid()
        if s not in self._index:
            if len(self._index) >= self.open_shards:
                old = next(iter(self._index))
                del self._index[old]
                os.close(self._fds.pop(old))
            entry = self.raw["shards"][s]
            self._index[s] = json.loads((self.root / entry["idx"]).read_text())
            self._fds[s] = os.open(self.root / entry["tar"], os.O_RDONLY)
        return self._index[s]

    def sample(self, i: int) -> Sample:
        """Sample ``i`` as ``{"__key__": key bytes, ext: bytes, ...}`` (WebDataset's layout)."""
        _, key, members = self.read_many([i])[0]
        return {"__key__": key.encode(), **{ext: bytes(m) for ext, m in members.items()}}

    def read_many(self, indices: Sequence[int]) -> list[tuple[int, str, dict[str, memoryview]]]:
        """Samples ``indices`` as ``(shard number, key, {ext: member bytes})``: one read per
        sample where its members lie together, as `pack` writes them (a member is then a
        writable memoryview into that read's buffer: ``torch.frombuffer`` takes it without a
        copy). Each read lets go of the GIL and takes it back; under a busy training thread
        taking it back is what costs, so one read instead of one per member (image + label)."""
        at = np.asarray(indices, dtype=np.int64)
        if at.size and (at.min() < 0 or at.max() >= len(self)):
            bad = next(i for i in at.tolist() if not 0 <= i < len(self))
            raise IndexError(f"sample {bad} out of range [0, {len(self)})")
        shards = np.searchsorted(self._starts, at, side="right") - 1
        within = (at - self._starts[shards]).tolist()
        if self._pid != os.getpid():
            # A forked child: the parent's lock may have been held by a thread it lacks.
            self._lock = threading.Lock()
        out = []
        with self._lock:
            for s, j in zip(shards.tolist(), within, strict=True):
                idx = self._shard_index(s)
                out.append((s, idx["keys"][j], _read_members(self._fds[s], idx["members"][j])))
        return out

    def __getitem__(self, i: int) -> Any:
        """Sample ``i`` through ``decode`` (the raw dict when there is none)."""
        raw = self.sample(i)
        return raw if self.decode is None else self.decode(raw)

    def close(self) -> None:
        """Close the open shard files."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._index.clear()


# Bytes between two members of one sample in a shard `pack` wrote: the first one's padding to
# 512 and the next one's header (a PAX header adds two blocks); more apart, they are read apart.
_MEMBER_GAP = 2048


def _read_members(fd: int, members: list) -> dict[str, memoryview]:
    """``{ext: bytes}`` of one sample's ``[ext, offset, size]`` members of the tar open as
    ``fd``: one read when they lie together, else one each. A short read (a truncated
    shard) gives shorter members, as ``os.pread`` would."""
    first = min(offset for _, offset, _ in members)
    end = max(offset + size for _, offset, size in members)
    if end - first > sum(size for _, _, size in members) + _MEMBER_GAP * len(members):
        return {ext: _read_at(fd, offset, size) for ext, offset, size in members}
    whole = _read_at(fd, first, end - first)
    return {ext: whole[offset - first:offset - first + size] for ext, offset, size in members}


def _read_at(fd: int, offset: int, size: int) -> memoryview:
    """``size`` bytes of ``fd`` at ``offset`` (fewer at its end) in a writable buffer."""
    buf = bytearray(size)
    return memoryview(buf)[:os.preadv(fd, [buf], offset)]


class SampleLoader:
    """Micro-batches of decoded samples in the global order; state = optimizer steps consumed."""

    def __init__(self, dataset: TarSamples, sampler):
        self.dataset = dataset
        self.sampler = sampler
        if sampler.group_sizes is None and len(dataset) == sampler.num_samples:
            sampler.set_groups(dataset.shard_sample_counts, dataset.window_shards)

    def next_step(self) -> list[list[Any]]:
        """This rank's ``grad_accum`` micro-batches of the next step, as lists of samples."""
        return [[self.dataset[i] for i in ix.tolist()] for ix in self.sampler.next_step()]

    def state_dict(self) -> dict[str, int]:
        """The position in the global order."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue after ``state['step']`` global batches."""
        self.sampler.load_state_dict(state)
