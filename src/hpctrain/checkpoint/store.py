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
import fcntl
import io
import logging
import mmap
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
from hpctrain.runtime.mounts import in_memory
from hpctrain.runtime.rundir import fsync_dir
from hpctrain.runtime.safe_open import UnsafeRunPath, current_umask, read_bytes, write_atomic

log = logging.getLogger("hpctrain.checkpoint")

LATEST = "latest"
DAMAGED = "damaged"
RETIRED = ".retired-"  # a checkpoint retention removed, being deleted


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
        self._removers: list[threading.Thread] = []  # retention's deleting threads
        self._removing: set[str] = set()  # the retired folders they delete
        self._removing_lock = threading.Lock()

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
            writer = _Writer(tmp, step, write_threads(self.cfg.write_threads),
                             direct=self.cfg.direct_io)
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
        not write itself are never touched. Each is renamed to ``.retired-<name>`` at once (no
        longer a checkpoint to anyone) and deleted by a thread: freeing a checkpoint's blocks
        took 0.3-0.4 s per GB here, time the commit no longer waits for. Retired folders left
        by a process that died while deleting them go with the next ones.
        """
        done = self.committed()
        keep = set(done[-self.cfg.keep_last:])
        if self.cfg.keep_every:
            keep |= {p for p in done if step_of(p.name) % self.cfg.keep_every == 0}
        latest = self.latest_name()
        for path in done:
            if path not in keep and path.name != latest:
                retired = self.root / f"{RETIRED}{path.name}"
                with self._removing_lock:
                    if retired.name in self._removing:  # the same step retired again
                        continue
                _clear(retired)
                os.rename(path, retired)
                log.info("checkpoint %s removed (retention)", path.name)
        with self._removing_lock:
            doomed = [p for p in self.root.iterdir()
                      if p.name.startswith(RETIRED) and p.name not in self._removing]
            self._removing.update(p.name for p in doomed)
        if doomed:
            thread = threading.Thread(target=self._remove, args=(doomed,), daemon=True,
                                      name="checkpoint-retention")
            self._removers = [t for t in self._removers if t.is_alive()] + [thread]
            thread.start()

    def _remove(self, doomed: list[Path]) -> None:
        """Delete retired checkpoints (the retention thread)."""
        for path in doomed:
            _clear(path)
            with self._removing_lock:
                self._removing.discard(path.name)

    def wait_removed(self) -> None:
        """Wait until the checkpoints retention retired are deleted (before the process ends:
        what a killed deletion leaves, the next retention deletes)."""
        for thread in self._removers:
            thread.join()
        self._removers = []

    # -- what is there ------------------------------------------------------------------------

    def committed(self) -> list[Path]:
        """Committed checkpoint directories, oldest first; anything else is warned about once."""
        if not self.root.is_dir():
            return []
        found = []
        for path in self.root.iterdir():
            step = step_of(path.name)
            # A link named step-N is not this run's: followed, it would load another folder.
            if step is not None and path.is_dir() and not path.is_symlink():
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

    def __init__(self, path: Path, step: int, threads: int, direct: bool = True):
        super().__init__(path, sync_files=True, thread_count=threads)
        self.fs = _HashingFileSystem(direct)
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
    file (the checksum costs no second read of the checkpoint: 0.66 of 6.4 s for 1 GB here,
    and on a real disk a read the page cache may no longer hold), written without the page
    cache where the file system allows it (``_HashingStream``)."""

    def __init__(self, direct: bool = True) -> None:
        super().__init__()
        self.direct = direct  # checkpoint.direct_io
        self.digests: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        """A file stream; a shard written from the start is hashed as it is written."""
        if mode != "wb" or not str(path).endswith(".distcp"):
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
                     | os.O_NOFOLLOW, 0o666)
        # On tmpfs the page cache is the storage: a direct write would only add a copy.
        with _HashingStream(fd, direct=self.direct and not in_memory(Path(path))) as hashing:
            yield hashing
        if hashing.sequential:
            with self._lock:
                self.digests[Path(path).name] = {"size": hashing.size,
                                                 "xxh3": hashing.hash.hexdigest()}


class _HashingStream(io.RawIOBase):
    """A write-only stream over a file descriptor that feeds each block to xxh3 right before
    it goes on (while the bytes are still in the CPU's cache), then writes whole
    ``_DIRECT_BLOCK`` blocks with ``O_DIRECT`` from aligned buffers, as ``bench disk`` does:
    a thread writes one block to the device while the next is filled.

    Buffered writes copied every byte into the page cache, which the fsync at the end then
    wrote out: on one core here 0.3-1.3 GB/s (and 1-2.7 CPU-s per 2 GB) against the device's
    1.4-1.6 GB/s with O_DIRECT, and a 13 GB checkpoint pushed as much of the training job's
    page cache out. The tail (less than a block) is written buffered when the file is handed
    to fsync (``fileno``) or closed. Where the file system refuses O_DIRECT (some network file
    systems) or holds its files in memory (tmpfs), everything is written buffered.
    """

    _HASH_BLOCK = 1 << 20
    _DIRECT_BLOCK = 16 << 20

    def __init__(self, fd: int, direct: bool = True):
        super().__init__()
        self.fd = fd
        self.hash = xxhash.xxh3_64()
        self.size = 0  # bytes written through write()
        self.sequential = True  # every byte of the file went through write(), in order
        self._pos = 0  # the stream's position (size, unless it was moved)
        self._blocks: list[mmap.mmap] = []  # two page-aligned buffers; none: writing buffered
        self._fill = 0  # bytes in the block being filled (_blocks[0])
        self._flushed = 0  # bytes of direct blocks handed to the file
        self._pending: Future[None] | None = None  # the other block's write
        self._pool: ThreadPoolExecutor | None = None
        if direct and _set_direct(fd, True):
            self._blocks = [mmap.mmap(-1, self._DIRECT_BLOCK) for _ in range(2)]

    def writable(self) -> bool:
        """Yes."""
        return True

    def write(self, b: Any) -> int:
        """Hash and write ``b`` (into the direct block, sent on when full)."""
        view = memoryview(b).cast("B")
        for start in range(0, len(view), self._HASH_BLOCK):
            chunk = view[start:start + self._HASH_BLOCK]
            self.hash.update(chunk)
            if self._blocks:
                self._buffer(chunk)
            else:
                _write_all(self.fd, chunk)
        self.size += len(view)
        self._pos += len(view)
        return len(view)

    def _buffer(self, chunk: memoryview) -> None:
        """Copy ``chunk`` into the direct block, sending the block on each time it fills."""
        while len(chunk):
            block = self._blocks[0]
            n = min(len(chunk), self._DIRECT_BLOCK - self._fill)
            block[self._fill:self._fill + n] = chunk[:n]
            self._fill += n
            chunk = chunk[n:]
            if self._fill < self._DIRECT_BLOCK:
                continue
            if self._flushed == 0 and not _write_direct(self.fd, block):
                # The first block, written here: a file system that refuses O_DIRECT says so
                # now. What of it reached the file (by its position) is not written again.
                done = os.lseek(self.fd, 0, os.SEEK_CUR)
                block[:self._fill - done] = block[done:self._fill]
                self._fill -= done
                self._finish_direct()
                _write_all(self.fd, chunk)  # the rest, buffered too
                return
            if self._flushed:
                self._wait()  # the other block is free again
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-write")
                self._pending = self._pool.submit(_write_direct, self.fd, block, strict=True)
            self._blocks.reverse()
            self._flushed += self._fill
            self._fill = 0

    def _wait(self) -> None:
        """Wait for the block being written (raises its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _finish_direct(self) -> None:
        """Write what the block holds buffered and go on buffered (the end of the file, or a
        file system that refused the direct write)."""
        if not self._blocks:
            return
        blocks, fill, pool = self._blocks, self._fill, self._pool
        self._blocks, self._fill, self._pool = [], 0, None
        try:
            self._wait()
            _set_direct(self.fd, False)
            view = memoryview(blocks[0])
            try:
                _write_all(self.fd, view[:fill])
            finally:
                view.release()  # else the block's mapping cannot be closed
        finally:
            if pool is not None:
                pool.shutdown(wait=True)
            for block in blocks:
                block.close()

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Moving the position breaks the running hash: the file is hashed after the write."""
        self._finish_direct()
        self.sequential = False
        self._pos = os.lseek(self.fd, offset, whence)
        return self._pos

    def tell(self) -> int:
        """The position in the file."""
        return self._pos

    def flush(self) -> None:
        """Nothing to do: DCP flushes after every tensor; a block is written when full, the
        tail when the file is fsynced or closed."""

    def fileno(self) -> int:
        """The file's descriptor, everything written now in the file (DCP fsyncs it)."""
        self._finish_direct()
        return self.fd

    def close(self) -> None:
        """Write the tail and close the file."""
        if not self.closed:
            try:
                self._finish_direct()
            finally:
                os.close(self.fd)
        super().close()


def _set_direct(fd: int, on: bool) -> bool:
    """Turn O_DIRECT on or off for ``fd``; False where the system or file system refuses."""
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        return False
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | direct if on else flags & ~direct)
    except OSError:
        return False
    return True


def _write_direct(fd: int, block: mmap.mmap, strict: bool = False) -> bool:
    """Write a whole aligned block with O_DIRECT; False when the file system refused it
    (EINVAL), unless ``strict`` (it accepted earlier blocks: the error is real)."""
    view = memoryview(block)
    try:
        _write_all(fd, view)
        return True
    except OSError as e:
        if strict or e.errno != errno.EINVAL:
            raise
        return False
    finally:
        view.release()  # else the block's mapping cannot be closed


def _write_all(fd: int, data: memoryview) -> None:
    """Write all of ``data`` at the file's position (a write may take less than asked)."""
    while len(data):
        data = data[os.write(fd, data):]


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

