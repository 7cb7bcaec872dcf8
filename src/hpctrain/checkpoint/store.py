"""Writing one checkpoint and committing it: the protocol every save follows, whichever process
writes it (the training process, or the rank's checkpoint writer process, see ``writer.py``).

1. rank 0 makes ``.tmp-step-N/`` (removing what a crashed save left there); all ranks meet;
2. DCP writes every rank's shards there (fsync on), each rank its RNG states, then hashes the
   files it wrote itself;
3. the ranks gather (error, disk full?, file hashes); with no error rank 0 writes the manifest,
   renames the folder into place, moves ``latest`` and applies retention, in that order;
4. rank 0 broadcasts the outcome, so every rank raises the same ``CheckpointError`` or none.

Collectives run on the group handed in: the training process's checkpoint group, or the writer
processes' own gloo group.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import SavePlanner

from hpctrain import faults
from hpctrain.checkpoint.config import CheckpointConfig
from hpctrain.checkpoint.manifest import (
    CheckpointError,
    DamagedCheckpoint,
    describe,
    read_manifest,
    step_dir_name,
    step_of,
    write_manifest,
)
from hpctrain.runtime.rundir import fsync_dir
from hpctrain.runtime.safe_open import UnsafeRunPath, current_umask, read_bytes, write_atomic

log = logging.getLogger("hpctrain.checkpoint")

LATEST = "latest"
DAMAGED = "damaged"


class CheckpointStore:
    """The ``checkpoints/`` folder of one run: write + commit, retention, what is committed."""

    def __init__(self, cfg: CheckpointConfig, root: Path, *, rank: int, world_size: int):
        self.cfg = cfg
        self.root = root
        self.rank = rank
        self.world_size = world_size
        # Size of the last checkpoint committed or loaded: what the next save will need.
        self.last_bytes: int | None = None
        self._warned: set[str] = set()

    # -- writing ------------------------------------------------------------------------------

    def write(self, step: int, state: dict, meta: dict, rng: dict, *,
              group: dist.ProcessGroup | None, planner: SavePlanner | None = None
              ) -> dict[str, Any]:
        """Write shards into a temporary directory, verify, then commit on rank 0.

        Returns the save's record (step, write_s, bytes, gb_per_s); raises CheckpointError on
        every rank when any rank failed, leaving the previous checkpoint as it was.
        """
        start = time.perf_counter()
        name = step_dir_name(step)
        tmp = self.root / f".tmp-{name}"
        if self.rank == 0:
            _clear(tmp)  # leftovers of a save that crashed (or a link planted there)
            # Owner-only while the ranks write into it: nobody else can plant a link at a shard
            # or rng file name in the meantime (checkpoints/ may be group-writable). It gets the
            # umask's mode back when committed.
            tmp.mkdir(mode=0o700, parents=True)
        dist.barrier(group=group)
        error, full, mine = None, False, {}
        try:
            writer = _Writer(tmp, step, write_threads(self.cfg.write_threads))
            dcp.save(state, storage_writer=writer, process_group=group,
                     planner=planner)
            rng_path = tmp / f"rng-rank-{self.rank:05d}.pt"
            _save_durable(rng, rng_path)
            # Each rank hashes the files it wrote itself, in parallel with the others: the
            # shards as they were written (no second read), the small files here.
            own = [rng_path, *tmp.glob(f"__{self.rank}_*.distcp")]
            if self.rank == 0:
                own.append(tmp / ".metadata")
            mine = {p.name: writer.hashed(p) or describe(p) for p in own}
        except (Exception, CheckpointException) as e:  # DCP's is a BaseException
            error = f"rank {self.rank}: {first_line(e)}"
            # torch.save reports a full disk as "unexpected pos" (the errno is lost): judge by
            # what is left now, before the partial files are removed.
            full = is_disk_full(e) or _less_free_than(tmp, state_bytes(state))
        results: list[Any] = [None] * self.world_size
        dist.all_gather_object(results, (error, full, mine, state_bytes(state)), group=group)
        errors = [err for err, _, _, _ in results if err]
        full = any(f for _, f, _, _ in results)
        total = sum(v["size"] for _, _, part, _ in results for v in part.values())
        if self.rank == 0:
            if not errors:
                files = {k: v for _, _, part, _ in results for k, v in part.items()}
                try:
                    self._commit(tmp, name, files, meta)
                except OSError as e:
                    errors.append(f"commit: {type(e).__name__}: {e}")
                    full = full or is_disk_full(e)
            if errors:
                _clear(tmp)
        outcome = [(errors, full)]
        dist.broadcast_object_list(outcome, src=0, group=group)
        errors, full = outcome[0]
        if errors:
            why = errors[0]
            if full:
                need = self.expected_bytes() or sum(b for _, _, _, b in results)
                why = f"{self.no_space(need)} ({why})"
            raise CheckpointError(f"the checkpoint at step {step} was not committed: {why}",
                                  hint=self.intact_hint())
        self.last_bytes = total
        write_s = time.perf_counter() - start
        return {"step": step, "write_s": write_s, "bytes": total,
                "gb_per_s": total / write_s / 1e9}

    def no_space(self, need: int) -> str:
        """The disk-full message: where, how much this checkpoint needs, how much is free."""
        free = free_bytes(self.root)
        have = f"{_gb(free)} GB free" if free is not None else "free space unknown"
        return f"no space left on {self.root}: this checkpoint needs ~{_gb(need)} GB, {have}"

    def intact_hint(self) -> str:
        """The hint of every failed save: which checkpoint a restart resumes from."""
        previous = self.latest_name()
        return (f"the previous checkpoint {previous or '(none)'} is intact and is what a restart "
                "resumes from; check free space and the file system (checkpoint.keep_last "
                "bounds how many are kept)")

    def expected_bytes(self) -> int | None:
        """The size of the last checkpoint committed or loaded, else of the newest on disk."""
        if self.last_bytes is None:
            for path in reversed(self.committed()):
                try:
                    self.last_bytes = manifest_bytes(read_manifest(path))
                    break
                except DamagedCheckpoint:
                    continue
        return self.last_bytes

    def _commit(self, tmp: Path, name: str, files: dict, meta: dict) -> None:
        """Manifest, rename into place, move ``latest``, then prune: in this order."""
        write_manifest(tmp, files, {**meta, "name": name})
        os.chmod(tmp, 0o777 & ~current_umask())  # readable by whom the umask says, like its files
        fsync_dir(tmp)
        final = self.root / name
        if final.exists():  # the same step saved again after a rollback
            trash = self.root / f".trash-{name}"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)
        fsync_dir(self.root)
        self.point_latest(name)
        self._prune()

    def point_latest(self, name: str) -> None:
        """Atomically make ``latest`` name ``name`` (a committed checkpoint)."""
        # Never through a link planted at ``latest`` or at a temp name (safe_open.py).
        write_atomic(self.root / LATEST, f"{name}\n".encode())

    def _prune(self) -> None:
        """Keep the last ``keep_last``, every ``keep_every``-th step, and ``latest``.

        Only ``step-NNNNNNNN`` directories are candidates: ``damaged/`` and anything the run did
        not write itself are never touched.
        """
        done = self.committed()
        keep = set(done[-self.cfg.keep_last:])
        if self.cfg.keep_every:
            keep |= {p for p in done if step_of(p.name) % self.cfg.keep_every == 0}
        latest = self.latest_name()
        for path in done:
            if path not in keep and path.name != latest:
                shutil.rmtree(path, ignore_errors=True)
                log.info("checkpoint %s removed (retention)", path.name)

    # -- what is there ------------------------------------------------------------------------

    def committed(self) -> list[Path]:
        """Committed checkpoint directories, oldest first; anything else is warned about once."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            step = step_of(path.name)
            if step is not None and path.is_dir():
                found.append((step, path))
            elif not path.name.startswith(".") and path.name not in (LATEST, DAMAGED):
                self.warn_once(path.name, "ignoring %s: not a checkpoint of this run (expected "
                               "step-NNNNNNNN directories); it is left as it is", path)
        return [path for _, path in sorted(found)]

    def latest_name(self) -> str | None:
        """The name ``latest`` points to, if it holds a checkpoint name."""
        try:
            raw = read_bytes(self.root / LATEST)
        except FileNotFoundError:
            return None
        except (OSError, UnsafeRunPath) as e:
            self.warn_once(LATEST, "ignoring %s: %s", self.root / LATEST, e)
            return None
        name = raw.decode("utf-8", "replace").strip()
        if step_of(name) is None:
            self.warn_once(LATEST, "ignoring %s: it holds %r, not a checkpoint name",
                           self.root / LATEST, name[:60])
            return None
        return name

    def warn_once(self, key: str, msg: str, *args: Any) -> None:
        """Log a warning about ``key`` the first time only."""
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)


class _Writer(FileSystemWriter):
    """DCP's file writer (fsync on) that hashes each shard file as it writes it, with the
    injected-fault seams inside the write phase, where DCP reports a rank's I/O error to every
    rank, as it does for a real full disk."""

    def __init__(self, path: Path, step: int, threads: int):
        super().__init__(path, sync_files=True, thread_count=threads)
        self.fs = _HashingFileSystem()
        self._step = step

    def hashed(self, path: Path) -> dict[str, Any] | None:
        """The manifest entry of a shard file hashed while written; None if it was not (or
        the file on disk is not what went through the hash)."""
        entry = self.fs.digests.get(path.name)
        if entry is None or path.stat().st_size != entry["size"]:
            return None
        return entry

    def write_data(self, plan, planner):
        faults.maybe_slow_save(self._step)
        faults.maybe_fail_save(self._step)
        return super().write_data(plan, planner)


class _HashingFileSystem(FileSystem):
    """DCP's local file system whose ``.distcp`` streams hash the bytes on their way to the
    file: the checksum costs no second read of the checkpoint (0.66 of 6.4 s for 1 GB here, and
    on a real disk a read the page cache may no longer hold)."""

    def __init__(self) -> None:
        super().__init__()
        self.digests: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        """A file stream; a shard written from the start is hashed as it is written."""
        if mode != "wb" or not str(path).endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as stream:
            hashing = _HashingStream(stream)
            yield hashing
        if hashing.sequential:
            with self._lock:
                self.digests[Path(path).name] = {"size": hashing.size,
                                                 "xxh3": hashing.hash.hexdigest()}


class _HashingStream(io.RawIOBase):
    """A write-only stream that feeds each block to xxh3 right before writing it (while the
    bytes are still in the CPU's cache)."""

    _BLOCK = 1 << 20

    def __init__(self, raw: io.BufferedIOBase):
        super().__init__()
        self.raw = raw
        self.hash = xxhash.xxh3_64()
        self.size = 0
        self.sequential = True  # every byte of the file went through write(), in order

    def writable(self) -> bool:
        """Yes."""
        return True

    def write(self, b: Any) -> int:
        """Hash and write ``b`` in cache-sized blocks."""
        view = memoryview(b).cast("B")
        for start in range(0, len(view), self._BLOCK):
            block = view[start:start + self._BLOCK]
            self.hash.update(block)
            self.raw.write(block)
        self.size += len(view)
        return len(view)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Moving the position breaks the running hash: the file is hashed after the write."""
        self.sequential = False
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        """The position in the file."""
        return self.raw.tell()

    def flush(self) -> None:
        """Flush the file (closing flushes too, after the file itself was closed)."""
        if not self.raw.closed:
            self.raw.flush()

    def fileno(self) -> int:
        """The file's descriptor (for fsync)."""
        return self.raw.fileno()

    def close(self) -> None:
        """Close the file."""
        if not self.closed:
            self.raw.close()
        super().close()


def write_threads(configured: int) -> int:
    """The threads (and files) each rank writes a checkpoint with: ``configured``, or for 0 half
    the CPU cores this rank may use (its share of the node's when no launcher bound it), 1-8."""
    if configured:
        return configured
    cores = len(os.sched_getaffinity(0))
    if cores == os.cpu_count():  # not bound to its own cores: share them with the node's ranks
        cores //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(8, cores // 2))


def causes(e: BaseException) -> list[BaseException]:
    """``e`` and, for DCP's wrapper, each rank's own exception."""
    if isinstance(e, CheckpointException) and e.failures:
        return [inner for inner, _trace in e.failures.values()]
    return [e]


def first_line(e: BaseException) -> str:
    """The root cause of an error in one line (DCP wraps each rank's traceback)."""
    inner = causes(e)[0]
    if isinstance(inner, CheckpointError):
        return inner.what.splitlines()[0]
    return f"{type(inner).__name__}: {inner}".splitlines()[0]


def is_disk_full(e: BaseException) -> bool:
    return any(isinstance(c, OSError) and c.errno in (errno.ENOSPC, errno.EDQUOT)
               for c in causes(e))


def _less_free_than(path: Path, n: int) -> bool:
    free = free_bytes(path)
    return free is not None and free < n


def manifest_bytes(manifest: dict[str, Any]) -> int:
    """Total bytes of a checkpoint's files, from its manifest."""
    return sum(entry["size"] for entry in manifest["files"].values())


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of the tensors this rank holds in ``state`` (its shard of a DTensor)."""
    total = 0
    for value in state.values():
        if isinstance(value, dict):
            total += state_bytes(value)
        elif isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            total += local.numel() * local.element_size()
    return total


def free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding ``path`` (or its nearest existing parent)."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def _gb(n: int) -> str:
    return f"{n / 1e9:.3g}"


def _save_durable(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _clear(path: Path) -> None:
    """Remove the folder ``path`` if there; a link planted in its place is removed, not followed."""
    if path.is_symlink():
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)

