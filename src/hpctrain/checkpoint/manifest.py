"""The manifest that makes a checkpoint trustworthy: every file's size and xxh3 checksum.

A checkpoint directory is only ever renamed into place after its manifest is written, so a
directory named ``step-*`` without a manifest that verifies is a damaged one, never a partial
write in progress. The manifest itself is read as untrusted input: every value it holds is
checked for type and consistency before anything acts on it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import threading
from collections.abc import Callable, Collection
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from hpctrain.errors import HpctrainError
from hpctrain.records import BadRecord, Int, Map, Record, Str
from hpctrain.runtime.rundir import write_json_atomic
from hpctrain.shown import quoted

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_CHUNK = 8 << 20
_STEP_DIR = re.compile(r"step-(\d+)")
# Files one rank writes: DCP's shards (``__<rank>_<n>.distcp``) and its RNG states.
_WRITER = re.compile(r"__(\d+)_\d+\.distcp|rng-rank-(\d+)\.pt")
# What read_manifest checks before anything acts on a manifest; the trainer's own fields
# (schedule, data position, ...) are checked by the trainer (train/checkpointing.py).
_MANIFEST = Record({
    "format_version": Int(FORMAT_VERSION, FORMAT_VERSION),
    "files": Map(Str(255), Record({"size": Int(), "xxh3": Str(
        16, pattern="[0-9a-f]{16}", what="16 hex digits (an xxh3-64 checksum)")}),
        max_len=1_000_000),
    "step": Int(),
})


class CheckpointError(HpctrainError):
    """A checkpoint is missing, damaged, or could not be written."""

    exit_code = 1


class DamagedCheckpoint(CheckpointError):
    """A checkpoint's files or values are damaged or hostile: resume falls back past it; named
    explicitly (``--resume PATH``) it is a usage error."""

    exit_code = 2


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a checkpoint directory name as ``step_dir_name`` writes it, else None."""
    match = _STEP_DIR.fullmatch(name)
    if match is None or step_dir_name(int(match[1])) != name:
        return None
    return int(match[1])


def is_int(value: object, minimum: int = 0) -> bool:
    """A JSON integer (not a bool) of at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def checksum(path: Path, stop: threading.Event | None = None,
             progress: Callable[[int], None] | None = None) -> str:
    """xxh3-64 of a file's bytes, hex (fast enough to hash GBs per second per core); ``stop``
    set: gives up between chunks (the result is then meaningless); ``progress``: called with
    the bytes read so far after each chunk."""
    h = xxhash.xxh3_64()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    done = 0
    with open_file(path) as f:
        if hasattr(os, "posix_fadvise"):  # read ahead more eagerly: a resume reads cold
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        while (n := f.readinto(buf)) and not (stop is not None and stop.is_set()):
            h.update(view[:n])
            done += n
            if progress is not None:
                progress(done)
    return h.hexdigest()


def open_file(path: Path) -> BinaryIO:
    """Open a checkpoint's file to read; DamagedCheckpoint if it is a symbolic link (followed,
    it would pull any file the reader can read into the weights) or not a regular file. The
    folder may be a link (a user's own choice); only the file's name is not followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise DamagedCheckpoint(f"{path} is a symbolic link (a checkpoint's files are "
                                    "its own)") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO would block a read forever
            raise DamagedCheckpoint(f"{path} is not a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return open(path, "rb", opener=lambda *_: fd)  # named by its path, for errors


def describe(path: Path) -> dict[str, Any]:
    """Size and checksum of one file, as the manifest records it."""
    return {"size": path.stat().st_size, "xxh3": checksum(path)}


def write_manifest(ckpt_dir: Path, files: dict[str, dict[str, Any]], meta: dict) -> None:
    """Write ``manifest.json`` (atomically) listing ``files`` and the trainer's ``meta``."""
    write_json_atomic(ckpt_dir / MANIFEST,
                      {"format_version": FORMAT_VERSION, "files": files, **meta})


def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """The parsed and checked manifest, or DamagedCheckpoint naming what is wrong with it."""
    path = ckpt_dir / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{path} is missing (the save never committed)") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise DamagedCheckpoint(f"{path} is unreadable: {e}") from None
    try:
        data = _MANIFEST.check(data, path)
    except BadRecord as e:
        raise DamagedCheckpoint(e.what, expected=e.expected) from None
    for name in data["files"]:
        if not is_plain_name(name):
            raise DamagedCheckpoint(f"{path} lists {quoted(name)}, which is not a file of this "
                                    "checkpoint (a plain file name is expected)")
    step = data["step"]
    named = step_of(ckpt_dir.name)
    if named is not None and named != step:
        raise DamagedCheckpoint(f"{path} says step {step}, its folder {ckpt_dir.name} says "
                                f"{named}")
    return data


def is_plain_name(name: object) -> bool:
    """A file name inside the checkpoint directory: no separators, no ``..``, not empty."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name)


def verification_share(names: Collection[str], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` verifies: those it wrote (its shards, its RNG states; with the same
    world size, what it loads, so each file is read on the node that needs it), the others
    (the index, another world size's) dealt out in turn."""
    mine, others = [], []
    for name in sorted(names):
        match = _WRITER.fullmatch(name)
        writer = int(match[1] or match[2]) if match else None
        if writer is not None and writer < world_size:
            if writer == rank:
                mine.append(name)
        else:
            others.append(name)
    return mine + others[rank::world_size]


def verify_files(ckpt_dir: Path, files: dict[str, dict[str, Any]], names: list[str]) -> None:
    """Check size and checksum of ``names``; raise DamagedCheckpoint naming the first bad file."""
    problem = Verification(ckpt_dir, files, names).problem()
    if problem is not None:
        raise problem


class Verification:
    """Size and checksum checks of ``names`` running in threads from construction on, so that
    the caller can do other work meanwhile (a resume loads the state while its files verify).

    The files are read in parallel (up to 8 at once: reads release the GIL, and a parallel
    file system serves several streams faster than one); the first bad one in ``names``' order
    is the one named. How far each file has been read is kept, so that a load can follow the
    checks through the page cache (``wait_read``) instead of reading the disk beside them.
    """

    def __init__(self, ckpt_dir: Path, files: dict[str, dict[str, Any]], names: list[str]):
        self._stop = threading.Event()
        self._futures: list[Future[CheckpointError | None]] = []
        # Bytes read so far of each file still being checked; a file leaves once its check ends.
        self._read: dict[str, int] = {}
        self._moved = threading.Condition()
        # Checked here, before a byte is read: a file missing, a link or of the wrong size is
        # a verdict that the load need not wait for (nor load the checkpoint first).
        self.known = next((problem for problem in (
            _problem(ckpt_dir / n, files[n], read=False) for n in names) if problem), None)
        if names and self.known is None:
            self._read = dict.fromkeys(names, 0)
            pool = ThreadPoolExecutor(max_workers=min(8, len(names)),
                                      thread_name_prefix="hpctrain-verify")
            self._futures = [pool.submit(self._check, ckpt_dir / n, files[n]) for n in names]
            pool.shutdown(wait=False)  # its threads end with the last check

    def _check(self, path: Path, want: dict[str, Any]) -> CheckpointError | None:
        try:
            return _problem(path, want, self._stop,
                            progress=lambda n: self._advance(path.name, n))
        finally:
            self._advance(path.name, None)

    def _advance(self, name: str, done: int | None) -> None:
        """``name`` read up to ``done`` bytes; None: its check is over."""
        with self._moved:
            if done is None:
                self._read.pop(name, None)
            else:
                self._read[name] = done
            self._moved.notify_all()

    def wait_read(self, name: str, end: int, give_up: threading.Event | None = None) -> None:
        """Until the check of ``name`` has read its first ``end`` bytes (which are then in the
        page cache where there is one), or will read no more of it: not one of these files,
        its check over or stopped, or ``give_up`` set."""
        with self._moved:
            while self._read.get(name, end) < end and not self._stop.is_set() and not (
                    give_up is not None and give_up.is_set()):
                # A timeout: ``give_up`` is set by threads that do not notify this condition.
                self._moved.wait(0.1)

    def problem(self) -> CheckpointError | None:
        """Wait for the checks; the first bad file's error in ``names``' order, or None
        (a CheckpointError that is not damage: the checks could not run, e.g. no memory)."""
        if self.known is not None:
            return self.known
        for future in self._futures:
            problem = result_polled(future)
            if problem is not None:
                self.cancel()  # the verdict is in: the files after it need not be read
                return problem
        return None

    def cancel(self) -> None:
        """Stop reading (between chunks) and wait for the threads; no verdict after this."""
        with self._moved:
            self._stop.set()
            self._moved.notify_all()
        for future in self._futures:
            future.cancel()
        for future in self._futures:
            if not future.cancelled():
                result_polled(future)  # waits; a stopped check's result means nothing


# How long the main thread blocks at a time while it waits for the checks. A signal that comes
# after the interpreter last looked for one and before a blocking wait starts is handled only
# once that wait returns: waiting without a timeout, a Ctrl-C at that moment was never seen.
_POLL_S = 0.1


def result_polled(future: Future[Any]) -> Any:
    """``future``'s result, waited for in short waits (a pending Ctrl-C is raised here). The
    waits are ``wait``'s, not ``result(timeout)``'s: that one's TimeoutError could also be the
    work's own."""
    while not wait([future], timeout=_POLL_S).done:
        pass
    return future.result()


def _problem(path: Path, want: dict[str, Any], stop: threading.Event | None = None, *,
             read: bool = True, progress: Callable[[int], None] | None = None
             ) -> CheckpointError | None:
    """What is wrong with one file against its manifest entry, if anything (None once
    ``stop`` is set; ``read`` False: all but the checksum; ``progress``: ``checksum``'s).
    Never raises: a check that raised on one rank would leave its peers waiting for its
    verdict; a failure to check stops the other checks."""
    try:
        return _file_problem(path, want, stop, read, progress)
    except MemoryError:
        if stop is not None:
            stop.set()
        return CheckpointError(f"checking {path} ran out of memory")
    except Exception as e:  # noqa: BLE001 - whatever reading it raised, it cannot be trusted
        if stop is not None:
            stop.set()
        return DamagedCheckpoint(f"{path} could not be checked: {type(e).__name__}: {e}")


def _file_problem(path: Path, want: dict[str, Any], stop: threading.Event | None,
                  read: bool, progress: Callable[[int], None] | None
                  ) -> DamagedCheckpoint | None:
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            # Followed, it would pull any file the reader can read into the weights.
            return DamagedCheckpoint(f"{path} is a symbolic link (a checkpoint's files are "
                                     "its own)")
        if not stat.S_ISREG(st.st_mode):
            return DamagedCheckpoint(f"{path} is not a regular file")
        if st.st_size != want["size"]:
            return DamagedCheckpoint(f"{path} is {st.st_size} bytes, the manifest says "
                                     f"{want['size']} (truncated or overwritten)")
        if not read:
            return None
        got = checksum(path, stop, progress)
    except FileNotFoundError:
        return DamagedCheckpoint(f"{path} is missing")
    except DamagedCheckpoint as e:  # replaced by a link since the check above
        return e
    except OSError as e:
        return DamagedCheckpoint(f"{path} is unreadable: {e}")
    if stop is not None and stop.is_set():
        return None
    if got != want["xxh3"]:
        return DamagedCheckpoint(f"{path} checksum {got} does not match the manifest's "
                                 f"{want['xxh3']} (corrupted)")
    return None
