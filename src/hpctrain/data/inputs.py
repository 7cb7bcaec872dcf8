"""The input files of ``data prepare``, ``data pack`` and ``data train-tokenizer``: found, vetted
and read defensively, because a shared input tree is writable by others.

- A symbolic link is followed only when it resolves inside the *input roots* (the directories and
  glob bases named, and files named explicitly): ``corpus/x.txt -> /etc/shadow`` is skipped with a
  warning that names it, unless ``follow_symlinks`` (``--follow-symlinks``) says otherwise.
- Directories are walked once each (a link to a directory already seen is not walked again, so
  link cycles end), real paths before links; `expand_inputs` also reads each file once however
  many links lead to it, preferring the path without a link.
- FIFOs, sockets and devices are skipped with a warning and never opened (opening a FIFO blocks
  until someone writes; ``/dev/zero`` never ends). Named explicitly, they are an error.
- An unreadable directory or file and a dangling link are errors: a dataset that is silently
  smaller than its inputs is worse than a refused run.
- `InputFile.open` opens the vetted real path with ``O_NOFOLLOW | O_NONBLOCK`` and checks with
  ``fstat`` that it is still the regular file that was vetted (same device and inode), so a file
  swapped for a link, a FIFO or another file between listing and reading is refused.
"""

from __future__ import annotations

import errno
import glob
import gzip
import io
import json
import logging
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from hpctrain.errors import DataError

log = logging.getLogger("hpctrain.data")

# Suffixes picked up when an input is a directory; an explicitly named file of any other suffix
# is read as one plain-text document.
KNOWN_SUFFIXES = (".txt", ".md", ".jsonl", ".jsonl.zst", ".json.gz", ".jsonl.gz", ".parquet")
FOLLOW_HINT = "pass --follow-symlinks to read it"
_KINDS = ((stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"))


def suffix(path: Path) -> str:
    """The known suffix of ``path`` (``.jsonl.zst``, ...) or its last suffix, lower case."""
    name = path.name.lower()
    for suf in sorted(KNOWN_SUFFIXES, key=len, reverse=True):
        if name.endswith(suf):
            return suf
    return path.suffix.lower()


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "special file")


def _readable(path: Path) -> bool:
    effective = os.access in os.supports_effective_ids
    return os.access(path, os.R_OK, effective_ids=effective)


@dataclass(frozen=True)
class InputFile:
    """A vetted regular file: the path it was found by, its real path and identity."""

    path: Path  # as found (messages, manifests)
    real: Path  # resolved and vetted; what is opened
    dev: int
    ino: int
    size: int

    def open(self) -> BinaryIO:
        """The file for reading, refused unless it is still the regular file that was vetted."""
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.real, flags)
        except OSError as e:
            raise DataError(f"cannot read input {str(self.path)!r}: {e.strerror}"
                            + (" (it was replaced by a symbolic link)"
                               if e.errno == errno.ELOOP else ""),
                            hint="check the file; inputs must not change during a run") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (self.dev, self.ino):
            os.close(fd)
            what = "another file" if stat.S_ISREG(st.st_mode) else f"a {_kind(st.st_mode)}"
            raise DataError(f"input {str(self.path)!r} was replaced by {what} after it was listed",
                            hint="inputs must not change during a run; run the command again")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")


def vet_file(path: Path) -> InputFile:
    """An explicitly named file: links are followed (the user named it), special files refused."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.lexists(path):
            raise DataError(f"input {str(path)!r} is a dangling symbolic link (to "
                            f"{os.readlink(path)!r})", hint="remove the link or restore its "
                            "target") from None
        raise DataError(f"input {str(path)!r} does not exist",
                        expected="a file, a directory or a glob pattern") from None
    except OSError as e:
        raise DataError(f"cannot read input {str(path)!r}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"input {str(path)!r} is a {_kind(st.st_mode)}, not a regular file",
                        expected="a file, a directory or a glob pattern")
    real = Path(os.path.realpath(path))
    if not _readable(real):
        raise DataError(f"cannot read input {str(path)!r}: Permission denied",
                        hint="make it readable, or leave it out of the inputs")
    return InputFile(path, real, st.st_dev, st.st_ino, st.st_size)


@dataclass(frozen=True)
class _Found:
    rel: str  # path below the walked top (or the glob base), link names kept
    file: InputFile
    via_link: bool  # reached through a symbolic link


class _Finder:
    """Walks input trees under the rules of this module's docstring."""

    def __init__(self, roots: list[Path], follow_symlinks: bool, exclude: set[Path]):
        self.roots = roots
        self.follow = follow_symlinks
        self.exclude = exclude

    def inside(self, real: Path) -> bool:
        """Whether ``real`` lies in one of the input roots."""
        return self.follow or any(real == r or real.is_relative_to(r) for r in self.roots)

    def entry(self, shown: Path, loc: Path, st: os.stat_result, want: Callable[[str], bool],
              via_link: bool) -> tuple[str, Path, os.stat_result, bool] | None:
        """(``"dir"`` or ``"file"``, real path, stat, via a link) of an entry; None if skipped.

        ``shown``: the path for messages; ``loc``: where the entry is, its parents resolved;
        ``st``: its lstat. A link is resolved and judged here.
        """
        real = loc
        if stat.S_ISLNK(st.st_mode):
            real = Path(os.path.realpath(loc))
            if not self.inside(real):
                log.warning("skipping %r: a symbolic link to %r, outside the inputs (%s)",
                            str(shown), str(real), FOLLOW_HINT)
                return None
            try:
                st = os.stat(loc)
            except OSError:
                if not want(shown.name):
                    return None
                raise DataError(f"input {str(shown)!r} is a dangling symbolic link (to "
                                f"{os.readlink(loc)!r})",
                                hint="remove the link or restore its target") from None
            via_link = True
        if stat.S_ISDIR(st.st_mode):
            return None if real in self.exclude else ("dir", real, st, via_link)
        if not want(shown.name):
            return None
        if not stat.S_ISREG(st.st_mode):
            log.warning("skipping %r: a %s, not a regular file", str(shown), _kind(st.st_mode))
            return None
        if not _readable(real):
            raise DataError(f"cannot read input {str(shown)!r}: Permission denied",
                            hint="make it readable, or leave it out of the inputs")
        return "file", real, st, via_link

    def walk(self, top: Path, want: Callable[[str], bool]) -> list[_Found]:
        """Regular files below ``top`` that ``want`` (by name), sorted by relative path."""
        top_real = Path(os.path.realpath(top))
        st = os.stat(top_real)
        seen = {(st.st_dev, st.st_ino)}
        found: list[_Found] = []
        # Directories to list: (relative path, real path, reached via a link). Links to
        # directories wait until every real directory is listed, so a directory reachable both
        # ways is walked under its real path, and only once.
        pending: list[tuple[str, Path, bool]] = [("", top_real, False)]
        linked: list[tuple[str, Path, tuple[int, int]]] = []
        while pending or linked:
            if not pending:
                linked.sort(key=lambda t: t[0], reverse=True)
                rel, real, ident = linked.pop()
                if ident not in seen:
                    seen.add(ident)
                    pending.append((rel, real, True))
                continue
            rel_dir, real_dir, via = pending.pop()
            for name, lst in self._list(top, rel_dir, real_dir):
                rel = f"{rel_dir}/{name}" if rel_dir else name
                got = self.entry(top / rel, real_dir / name, lst, want, via)
                if got is None:
                    continue
                what, real, est, link = got
                ident = (est.st_dev, est.st_ino)
                if what == "file":
                    found.append(_Found(rel, InputFile(top / rel, real, *ident, est.st_size),
                                        link))
                elif stat.S_ISLNK(lst.st_mode):
                    linked.append((rel, real, ident))
                elif ident not in seen:
                    seen.add(ident)
                    pending.append((rel, real, link))
        return sorted(found, key=lambda f: f.rel)

    @staticmethod
    def _list(top: Path, rel_dir: str, real_dir: Path) -> list[tuple[str, os.stat_result]]:
        """Non-hidden entries of a directory and their lstat; unreadable is an error."""
        shown = top / rel_dir if rel_dir else top
        try:
            with os.scandir(real_dir) as it:
                return sorted((e.name, e.stat(follow_symlinks=False)) for e in it
                              if not e.name.startswith("."))
        except OSError as e:
            raise DataError(f"cannot list input directory {str(shown)!r}: {e.strerror}",
                            hint="make it readable, or leave it out of the inputs: a dataset "
                            "silently missing a directory is worse than an error") from None


def _glob_base(pattern: str) -> Path:
    """The leading directories of ``pattern`` that hold no glob magic."""
    parts = Path(pattern).parts
    fixed = parts[: next((i for i, p in enumerate(parts) if glob.has_magic(p)), len(parts))]
    return Path(*fixed) if fixed else Path(".")


def walk_tree(top: Path, *, follow_symlinks: bool = False,
              exclude: set[Path] | None = None) -> list[tuple[str, InputFile]]:
    """(relative path, file) of every non-hidden regular file below ``top``, sorted.

    A file reached through several links is listed under each (``data pack`` keeps them as
    samples of their own); directories are walked once. ``exclude``: real directory paths.
    """
    finder = _Finder([Path(os.path.realpath(top))], follow_symlinks, exclude or set())
    return [(f.rel, f.file) for f in finder.walk(top, lambda name: True)]


def expand_inputs(inputs: list[str], *, follow_symlinks: bool = False) -> list[InputFile]:
    """Files named by ``inputs`` (files, directories, globs), in a fixed order, each once."""
    kinds = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            kinds.append(("dir", item, Path(os.path.realpath(p))))
        elif os.path.lexists(p) or not glob.has_magic(item):
            kinds.append(("file", item, Path(os.path.realpath(p))))
        else:
            kinds.append(("glob", item, Path(os.path.realpath(_glob_base(item)))))
    finder = _Finder([root for _, _, root in kinds], follow_symlinks, set())
    found: list[_Found] = []
    for kind, item, root in kinds:
        if kind == "dir":
            here = finder.walk(Path(item), lambda name: suffix(Path(name)) in KNOWN_SUFFIXES)
            if not here:
                raise DataError(f"input directory {item!r} holds no files ending in "
                                f"{', '.join(KNOWN_SUFFIXES)}", hint="name the files explicitly")
        elif kind == "file":
            f = vet_file(Path(item))
            here = [_Found(Path(item).name, f, False)]
        else:
            here = _glob(finder, item, root)
            if not here:
                raise DataError(f"input pattern {item!r} matches no files")
        found += here
    if not found:
        raise DataError("no input files given", hint="hpctrain data prepare INPUT... --out DIR")
    # Each file once: the occurrence without a link if there is one, else the first.
    best: dict[tuple[int, int], int] = {}
    for i, f in enumerate(found):
        ident = (f.file.dev, f.file.ino)
        j = best.get(ident)
        if j is None or (found[j].via_link and not f.via_link):
            best[ident] = i
    keep = sorted(best.values())
    kept = set(keep)
    for f in (f for i, f in enumerate(found) if not f.via_link and i not in kept):
        log.warning("reading %r once although it is named more than once", str(f.file.path))
    return [found[i].file for i in keep]


def _glob(finder: _Finder, pattern: str, base_real: Path) -> list[_Found]:
    """Regular files matching ``pattern``, held to the same rules as a directory walk."""
    base = _glob_base(pattern)
    out = []
    for match in sorted(glob.glob(pattern, recursive=True), key=Path):  # the order it always had
        path = Path(match)
        try:
            lst = os.lstat(path)
        except OSError as e:
            raise DataError(f"cannot read input {match!r}: {e.strerror}") from None
        # Directories between the base and the match may be links: judge the resolved path.
        real = Path(os.path.realpath(path))
        if not finder.inside(real):
            log.warning("skipping %r: it resolves to %r, outside the inputs (%s)", match,
                        str(real), FOLLOW_HINT)
            continue
        rel = os.path.relpath(path, base)
        loc = Path(os.path.realpath(path.parent)) / path.name
        got = finder.entry(path, loc, lst, lambda name: True, real != base_real / rel)
        if got is not None and got[0] == "file":
            _, real, st, link = got
            out.append(_Found(rel, InputFile(path, real, st.st_dev, st.st_ino, st.st_size),
                              link))
    return out


# -- reading documents -------------------------------------------------------------------------


def _json_lines(stream: io.TextIOBase, path: Path, field: str | None) -> Iterator[Any]:
    first = True
    for lineno, line in enumerate(stream, 1):
        if first and line.lstrip().startswith("["):  # a JSON array of records, not JSON lines
            yield from _json_array(line + stream.read(), path, field)
            return
        first = False
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e})") from None
        if field is None:
            yield record
            continue
        if not isinstance(record, dict) or field not in record:
            raise DataError(f"{path}:{lineno}: record has no field {field!r}",
                            hint="name the text field with --text-field")
        yield record[field]


def _json_array(text: str, path: Path, field: str | None) -> Iterator[Any]:
    try:
        records = json.loads(text)
    except ValueError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    if field is None:
        yield from records
        return
    for i, record in enumerate(records):
        if not isinstance(record, dict) or field not in record:
            raise DataError(f"{path}: record {i} has no field {field!r}",
                            hint="name the text field with --text-field")
        yield record[field]


def _optional(module: str, path: Path, package: str):
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise DataError(f"reading {str(path)!r} needs the '{package}' package, which is not "
                        "installed", hint=f"pip install {package}  (or: pip install "
                        "'hpctrain[data]')") from None


def read_documents(source: InputFile | Path, field: str | None = "text") -> Iterator[Any]:
    """The documents of one input file, in file order; unreadable input is a DataError.

    ``field=None``: the whole records of a JSON or Parquet file (fine-tuning examples).
    """
    f = source if isinstance(source, InputFile) else vet_file(Path(source))
    try:
        yield from _documents(f, field)
    except DataError:
        raise
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise DataError(f"cannot read input {str(f.path)!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - zstd/arrow errors: report the file, not a traceback
        raise DataError(f"cannot read input {str(f.path)!r}: {type(e).__name__}: {e}") from None


def _documents(f: InputFile, field: str | None) -> Iterator[Any]:
    suf = suffix(f.path)
    with f.open() as raw:
        if suf in (".jsonl", ".jsonl.zst", ".json.gz", ".jsonl.gz"):
            if suf == ".jsonl.zst":
                zstd = _optional("zstandard", f.path, "zstandard")
                stream = zstd.ZstdDecompressor().stream_reader(raw, closefd=False)
            elif suf.endswith(".gz"):
                stream = gzip.GzipFile(fileobj=raw, mode="rb")
            else:
                stream = raw
            with io.TextIOWrapper(stream, encoding="utf-8", errors="replace") as text:
                yield from _json_lines(text, f.path, field)
        elif suf == ".parquet":
            pq = _optional("pyarrow.parquet", f.path, "pyarrow")
            pf = pq.ParquetFile(raw)
            if field is None:
                for batch in pf.iter_batches():
                    yield from batch.to_pylist()
                return
            if field not in pf.schema_arrow.names:
                raise DataError(f"{f.path}: no column {field!r} (columns: "
                                f"{', '.join(pf.schema_arrow.names)})",
                                hint="name the text column with --text-field")
            for batch in pf.iter_batches(columns=[field]):
                yield from (t for t in batch.column(0).to_pylist() if t is not None)
        elif field is None:
            raise DataError(f"{f.path}: fine-tuning examples are JSON records",
                            expected="a .jsonl, .jsonl.zst, .json.gz or .parquet file")
        else:
            yield raw.read()
