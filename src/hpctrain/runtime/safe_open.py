"""Opening files inside a run directory without following links planted there.

Run directories often live in group-writable project space. Whoever can write one can put a
symbolic link at a name the run writes (``logs/rank-000.log -> ~/.venv/.../x.pth``), and the
owner's next resume would write through it into any file the owner can write. So every writer
of a run directory goes through this module:

- the file's folder is opened with ``O_NOFOLLOW | O_DIRECTORY`` and the file relative to that
  descriptor with ``O_NOFOLLOW``: a link at either name is refused, and the folder cannot be
  swapped for a link between the check and the open;
- only a regular file is written, and an existing one only if it has a single name (a FIFO, a
  device or a hard link to someone else's file is refused);
- a whole file is replaced atomically: a temp file with an unpredictable name made with
  ``O_CREAT | O_EXCL`` (mode 0o666 less the umask, like every other file the run writes, or
  the caller's ``mode`` from the start, e.g. 0o600 for a file only its owner may write),
  then ``os.replace`` onto the final name, which replaces a link there instead of following it.

    with open_append(run_dir.rank_log(0)) as f: f.write("...")
    write_atomic(run_dir.exit_info_path, b"{...}")
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO, TextIO

from hpctrain.errors import HpctrainError

_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
# A FIFO planted at a file name would block an open for writing until someone reads it.
_PROBE = _NOFOLLOW | os.O_NONBLOCK
_HINT = ("someone who can write this run directory may have planted it to make the run "
         "write elsewhere: check who made it (ls -l), remove it, and keep run directories "
         "writable by their owner only (chmod go-w)")


class UnsafeRunPath(HpctrainError):
    """A name inside a run directory is a link, or not the kind of file the run writes there."""


def refuse(path: Path, what: str) -> UnsafeRunPath:
    """The error for ``path`` being ``what`` (e.g. "a symbolic link") where the run writes."""
    return UnsafeRunPath(f"{path} is {what}, where the run writes its own file or folder",
                         expected="a regular file or folder, not a link", hint=_HINT)


def open_dir(folder: Path) -> int:
    """A descriptor of ``folder``; UnsafeRunPath if it is a link or not a folder."""
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError as e:
        # Linux says ENOTDIR for a link with O_DIRECTORY | O_NOFOLLOW, others ELOOP.
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise refuse(folder, "a symbolic link" if os.path.islink(folder)
                         else "not a folder") from None
        raise


def make_dir(folder: Path) -> None:
    """Create ``folder`` (and its parents) unless it exists; refuse one that is a link."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    os.close(open_dir(folder))


def _open(path: Path, flags: int, *, dir_fd: int, write: bool) -> int:
    """Open ``path.name`` in the folder ``dir_fd`` without following a link; regular files only."""
    try:
        fd = os.open(path.name, flags | _PROBE, 0o666, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise refuse(path, "a symbolic link") from None
        if e.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO without reader; a folder
            raise refuse(path, "not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refuse(path, "not a regular file")
        if write and st.st_nlink > 1:
            raise refuse(path, f"a hard link ({st.st_nlink} names for one file)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_append(path: Path, *, buffering: int = -1) -> TextIO:
    """Open ``path`` (created if missing) to append UTF-8 text, never through a link."""
    path = Path(path)
    folder = open_dir(path.parent)
    try:
        fd = _open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, dir_fd=folder, write=True)
    finally:
        os.close(folder)
    return os.fdopen(fd, "a", encoding="utf-8", buffering=buffering)


def open_read(path: Path) -> BinaryIO:
    """Open the regular file ``path`` to read, never through a link and never blocking on a
    FIFO planted in its place (UnsafeRunPath)."""
    path = Path(path)
    folder = open_dir(path.parent)
    try:
        fd = _open(path, os.O_RDONLY, dir_fd=folder, write=False)
    finally:
        os.close(folder)
    return os.fdopen(fd, "rb")


def read_bytes(path: Path) -> bytes:
    """The content of the regular file ``path``, never read through a link (UnsafeRunPath)."""
    with open_read(path) as f:
        return f.read()


def write_atomic(path: Path, data: bytes, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` so readers see the old file or the new one, never half;
    the new file gets exactly ``mode`` when given (else 0o666 less the umask)."""
    path = Path(path)
    folder = open_dir(path.parent)
    try:
        # The temp file must be in the same folder: os.replace is atomic only within one
        # filesystem. Its name is random, so nobody can plant a link there beforehand.
        tmp = f".{path.name}.{secrets.token_hex(8)}.tmp"
        # A private file is private from its creation: chmod'ed later, someone the umask let
        # in could open it for writing meanwhile and keep the handle.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW,
                     0o666 if mode is None else mode, dir_fd=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                if mode is not None:
                    os.fchmod(f.fileno(), mode)  # exactly: the umask may have taken bits
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.replace(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
            except IsADirectoryError:
                raise refuse(path, "a folder") from None
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=folder)
            raise
        # Without it a node crash can lose the renamed file's new directory entry.
        # (Some filesystems refuse fsync on a directory; the data is written.)
        with contextlib.suppress(OSError):
            os.fsync(folder)
    finally:
        os.close(folder)


def current_umask() -> int:
    """This process's umask (os.umask can only be read by setting it: put back at once)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask
