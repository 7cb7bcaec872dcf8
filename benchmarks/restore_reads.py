"""How fast a node's disk serves the reads a checkpoint restore makes, against ``bench disk``'s.

    python benchmarks/restore_reads.py runs/bc --size 11e9 --threads 8

A restore reads its files through the page cache (the checksum threads and the load follow each
other through it), ``bench disk`` with ``O_DIRECT``: where the disk needs many requests in flight
to reach its speed, the page cache's read-ahead (a few hundred KiB a file by default) may be what
sets the restore's pace. This writes ``--threads`` files of ``--size`` bytes in all under the
path, then reads them, a thread a file, the page cache dropped before each way of reading:

- ``o_direct``: 16 MiB ``O_DIRECT`` reads (``bench disk``'s read), where the file system takes them;
- ``buffered``: 8 MiB reads through the page cache, as the checksum threads read;
- ``buffered_willneed``: the same, asking for the next 32-64 MiB ahead (``POSIX_FADV_WILLNEED``).

Each way ``--repeats`` times, alternating; prints GB/s and the ratio to ``o_direct``, and the
device's ``read_ahead_kb``. The files are removed afterwards.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hpctrain.bench.disk import drop_cached

_BLOCK = 16 << 20
_CHUNK = 8 << 20
_AHEAD = 32 << 20


def _write(path: Path, nbytes: int) -> None:
    block = os.urandom(_BLOCK)
    with open(path, "wb") as f:
        for _ in range(-(-nbytes // _BLOCK)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def _read(path: Path, way: str) -> int:
    direct = way == "o_direct"
    buf = mmap.mmap(-1, _BLOCK if direct else _CHUNK)  # page-aligned, as O_DIRECT wants
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        done = asked = 0
        while True:
            if way == "buffered_willneed" and asked < done + _AHEAD:
                os.posix_fadvise(fd, asked, done + 2 * _AHEAD - asked, os.POSIX_FADV_WILLNEED)
                asked = done + 2 * _AHEAD
            n = os.preadv(fd, [buf], done)
            if n <= 0:
                return done
            done += n
    finally:
        os.close(fd)
        buf.close()


def _read_ahead_kb(path: Path) -> str:
    dev = os.stat(path).st_dev
    try:
        block = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}").resolve()
        for d in (block, block.parent):
            if (d / "queue" / "read_ahead_kb").exists():
                return (d / "queue" / "read_ahead_kb").read_text().strip()
    except OSError:
        pass
    return "?"


def main() -> None:
    """Write the files, read them each way, print the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("path", type=Path)
    ap.add_argument("--size", type=float, default=2e9, help="bytes in all")
    ap.add_argument("--threads", type=int, default=8, help="files, a thread each")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix=".restore-reads-", dir=args.path))
    ways = ["o_direct", "buffered", "buffered_willneed"]
    try:
        files = [work / f"part-{i:03d}" for i in range(args.threads)]
        per_file = int(args.size) // args.threads
        with ThreadPoolExecutor(args.threads) as pool:
            list(pool.map(lambda f: _write(f, per_file), files))
            gbps: dict[str, list[float]] = {way: [] for way in ways}
            for _ in range(args.repeats):
                for way in ways:
                    for f in files:
                        drop_cached(f)
                    start = time.perf_counter()
                    try:
                        total = sum(pool.map(lambda f, way=way: _read(f, way), files))
                    except OSError as e:  # O_DIRECT refused (tmpfs, some network file systems)
                        print(f"{way}: {e}")
                        continue
                    gbps[way].append(total / (time.perf_counter() - start) / 1e9)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = statistics.median(gbps["o_direct"]) if gbps["o_direct"] else None
    print(f"{args.path}: {args.threads} files, {args.size / 1e9:.1f} GB, "
          f"read_ahead_kb {_read_ahead_kb(args.path)}")
    for way in ways:
        if gbps[way]:
            median = statistics.median(gbps[way])
            ratio = f"{median / base:.2f}" if base else "-"
            print(f"{way:18s} {median:6.2f} GB/s  (runs {', '.join(f'{g:.2f}' for g in gbps[way])})"
                  f"  of o_direct {ratio}")


if __name__ == "__main__":
    main()
