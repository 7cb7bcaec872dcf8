"""Sequential write and read bandwidth of a folder's file system: what a checkpoint can reach.

    hpctrain bench disk /scratch/$USER --size 8G --threads 8

Each thread writes its own file in large blocks of random bytes (a file system that compresses or
deduplicates zeros would flatter itself), then every file is fsynced: the write time ends after
the last fsync. Writes use ``O_DIRECT`` where the file system allows it (no page cache, the device's
own speed); tmpfs and some network file systems refuse it, and then writes are buffered and the
fsync makes them durable (the method column says which). Reads come from the device, not the page
cache: ``O_DIRECT`` again, else the pages are dropped first with ``posix_fadvise(DONTNEED)``
(which works for clean pages, and fsync made them clean); on tmpfs the memory *is* the storage,
and the method says so. GB/s are 1e9 bytes per second. The files are removed afterwards, also
when the benchmark fails.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpctrain.bench.common import Results
from hpctrain.errors import ConfigError
from hpctrain.runtime.mounts import filesystem, in_memory

COLUMNS = ["op", "size", "threads", "block", "seconds", "gbps", "method"]
_DIRECT = getattr(os, "O_DIRECT", 0)


@dataclass(frozen=True)
class DiskResult:
    """One direction's measurement."""

    op: str
    size: int
    threads: int
    block: int
    seconds: float
    method: str

    @property
    def gbps(self) -> float:
        """Bandwidth in GB/s (1e9 bytes)."""
        return self.size / self.seconds / 1e9


def check_folder(path: Path) -> None:
    """Refuse a path that is not a writable directory, with what was expected."""
    if not path.exists():
        raise ConfigError(f"{path} does not exist", expected="a directory on the file system "
                          "to measure", hint="create it first, or name its parent")
    if not path.is_dir():
        raise ConfigError(f"{path} is not a directory", expected="a directory on the file "
                          "system to measure", hint="name the folder checkpoints go to")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{path} is not writable by this user", expected="a directory you "
                          "can create files in", hint="measure a folder of your own, e.g. "
                          "your scratch space")


def fs_type(path: Path) -> str | None:
    """The file system type of ``path`` (`runtime.mounts`), or None if the table is unreadable."""
    kind = filesystem(path)
    return None if kind == "unknown" else kind


def run_disk(path: Path, size: int, *, threads: int = 4, block: int = 16 << 20,
             echo: Callable[[str], None] | None = None) -> list[DiskResult]:
    """Write then read ``size`` bytes in ``threads`` files under ``path``; [write, read]."""
    check_folder(path)
    threads = max(1, threads)
    block = max(mmap.PAGESIZE, block // mmap.PAGESIZE * mmap.PAGESIZE)
    per_file = max(block, -(-size // threads // block) * block)
    total = per_file * threads
    free = shutil.disk_usage(path).free
    if total > free * 0.9:
        raise ConfigError(f"bench disk needs {total / 1e9:.2f} GB under {path}, "
                          f"{free / 1e9:.2f} GB are free", hint="use a smaller --size")
    memory_fs = in_memory(path)
    work = Path(tempfile.mkdtemp(prefix=".hpctrain-bench-disk-", dir=path))
    try:
        files = [work / f"part-{i:03d}" for i in range(threads)]
        direct = _DIRECT != 0 and not memory_fs and _direct_works(work / "probe", block)
        how = "O_DIRECT" if direct else "buffered + fsync (O_DIRECT refused by this file system)"
        if echo:
            echo(f"bench disk: writing {total / 1e9:.2f} GB in {threads} files, {how}")
        seconds = _parallel(files, lambda f: _write_file(f, per_file, block, direct))
        write = DiskResult("write", total, threads, block, seconds,
                           "O_DIRECT + fsync" if direct else "buffered + fsync")
        if direct:
            read_how = "O_DIRECT"
        elif memory_fs:
            read_how = "page cache (tmpfs: the memory is the storage)"
        else:
            read_how = "buffered, pages dropped first (posix_fadvise DONTNEED)"
            for f in files:
                drop_cached(f)
        if echo:
            echo(f"bench disk: reading {total / 1e9:.2f} GB, {read_how}")
        seconds = _parallel(files, lambda f: _read_file(f, block, direct))
        return [write, DiskResult("read", total, threads, block, seconds, read_how)]
    except OSError as e:
        raise ConfigError(f"bench disk under {path} failed: {type(e).__name__}: {e}",
                          hint="check free space and permissions of the folder") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def disk_results(rows: list[DiskResult], path: Path) -> Results:
    """The measurement as bench results (CSV + JSON)."""
    res = Results("disk", COLUMNS, meta={"path": str(path), "fs_type": fs_type(path),
                                         "gb": "1e9 bytes"})
    for r in rows:
        res.add(op=r.op, size=r.size, threads=r.threads, block=r.block, seconds=r.seconds,
                gbps=r.gbps, method=r.method)
    return res


def _buffer(block: int) -> mmap.mmap:
    """A page-aligned block of random bytes (O_DIRECT wants aligned memory)."""
    buf = mmap.mmap(-1, block)
    seed = os.urandom(1 << 20)
    for start in range(0, block, len(seed)):
        buf[start:start + len(seed)] = seed[:block - start]
    return buf


def _direct_works(probe: Path, block: int) -> bool:
    """Whether this file system takes an O_DIRECT write (tmpfs and some others refuse it)."""
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _DIRECT, 0o600)
    except OSError:
        return False
    buf = _buffer(mmap.PAGESIZE)
    try:
        os.write(fd, buf)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        buf.close()
        probe.unlink()


def _write_file(path: Path, nbytes: int, block: int, direct: bool) -> None:
    buf = _buffer(block)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | (_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    try:
        done = 0
        while done < nbytes:
            done += os.write(fd, buf)
        os.fsync(fd)
    finally:
        os.close(fd)
        buf.close()


def _read_file(path: Path, block: int, direct: bool) -> None:
    buf = mmap.mmap(-1, block)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | (_DIRECT if direct else 0))
    try:
        while os.readv(fd, [buf]) > 0:
            pass
    finally:
        os.close(fd)
        buf.close()


def read_cold(files: list[Path], block: int = 16 << 20) -> float:
    """Seconds to read ``files`` start to end through the page cache, one thread each, their
    pages dropped first: how a checkpoint's restore reads, beside ``run_disk``'s O_DIRECT."""
    for f in files:
        drop_cached(f)
    return _parallel(files, lambda f: _read_file(f, block, direct=False))


def drop_cached(path: Path) -> None:
    """Drop the clean pages of a file from the page cache (no-op where that is not possible)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _parallel(files: list[Path], work: Callable[[Path], None]) -> float:
    """Run ``work`` on every file in its own thread (the syscalls release the GIL); seconds."""
    errors: list[BaseException] = []

    def one(f: Path) -> None:
        try:
            work(f)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller below
            errors.append(e)

    pool = [threading.Thread(target=one, args=(f,), daemon=True) for f in files]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    seconds = time.perf_counter() - start
    if errors:
        raise errors[0]
    return seconds
