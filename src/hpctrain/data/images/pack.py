"""Pack images (an ImageFolder tree or a path,label table) into tar shards, one folder per split.

    hpctrain data pack-images photos/ --out data/photos --val-fraction 0.02
    hpctrain data pack-images photos/labels.csv --out data/photos   # rows: path,label[,split]

Inputs:
- a directory in ImageFolder layout ``CLASS/.../FILE`` (classes: the top folders), or with the
  splits given as ``train/CLASS/...`` and ``val/CLASS/...``;
- a ``.csv``, ``.parquet`` or ``.jsonl`` table with the columns ``path`` and ``label`` (and an
  optional ``split``: train or val); paths are relative to the table's folder, and one that leaves
  it (``../x``, ``/x``) is refused.
Files are found as for text (`hpctrain.data.inputs`): a symbolic link out of the tree is skipped
with a warning (``--follow-symlinks`` reads it), and a file the listing finds unreadable (its
permissions) is an error, as for text. A file that is no image by its first bytes, fails to read
(an I/O error, gone or replaced since the listing) or that a table names but does not exist is
named in a warning, left out and listed under ``skipped`` in the manifest.

Output ``OUT/``: ``manifest.json`` (format ``hpctrain-images``: classes, per split the sample,
shard and per-class counts, the skipped files, the settings) and a folder per split, ``train/``
and ``val/``. Each is an hpctrain-tar directory (`hpctrain.data.tar_samples`: ``shard-NNNNNN.tar``
+ ``.idx.json``, a manifest with sizes, SHA-256 checksums, the classes, per-class counts per split
and per shard) that `TarSamples`, ``hpctrain data verify`` and WebDataset read as they are. A
sample is ``KEY.jpg`` (the file's bytes unchanged; ``.png`` etc. for other formats) and ``KEY.cls``
(the label index in decimal); KEY is the input path without its suffix.

Classes are sorted (as numbers when every label is an integer); a label is its class's index.
The samples of a split are shuffled once, by ``--seed``, before they are cut into shards of about
``--shard-mb``: otherwise a shard would hold one or two classes, and the loader, which shuffles in
windows of a few shards, would feed batches of a handful of classes. ``--val-fraction F`` moves
``round(F * n)`` files of each class (picked by a seeded hash of their path) to ``val``.

Resumable like ``data prepare``: after each shard ``OUT/pack.partial.json`` records the finished
ones; the same command run again checks them (checksums) and continues after the last good one.
The same inputs and settings give byte-identical shards and manifests.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import shutil
import tarfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hpctrain.data.images.listing import (
    SPLITS,
    TABLE_SUFFIXES,
    Entry,
    assign_splits,
    class_names,
    from_folder,
    from_table,
    tar_keys,
)
from hpctrain.data.images.reader import (
    IMAGES_FORMAT,
    IMAGES_VERSION,
    PACK_IMAGES_HINT,
    read_manifest,
)
from hpctrain.data.images.sniff import HEAD_BYTES, image_ext
from hpctrain.data.inputs import InputFile, suffix
from hpctrain.data.progress import BytesProgress
from hpctrain.data.shards import atomic_write_json, file_checksum, make_out_dir
from hpctrain.data.tar_samples import (
    MANIFEST,
    TAR_FORMAT,
    TAR_VERSION,
    finish_tar,
    load_tar_manifest,
    tar_member,
    verify_tar,
)
from hpctrain.errors import ConfigError, DataError
from hpctrain.runtime.rundir import fsync_dir

log = logging.getLogger("hpctrain.data")

PARTIAL = "pack.partial.json"
# What a pack writes in a split folder; and what a pack killed before its first checkpoint
# leaves there (the shard being written, an index's atomic-write temporary).
_OURS = re.compile(r"shard-\d{6}\.(tar|tar\.tmp|idx\.json)|manifest\.json"
                   r"|\.(shard-\d{6}\.idx|manifest)\.json\.[0-9a-f]+\.tmp")
_LEFTOVER = re.compile(r"shard-\d{6}\.tar\.tmp|\.shard-\d{6}\.idx\.json\.[0-9a-f]+\.tmp")
DEFAULT_SHARD_BYTES = 1 << 30
DEFAULT_READERS = 8


@dataclass(frozen=True)
class PackSettings:
    """What makes two packs the same job (besides the input listing)."""

    shard_bytes: int = DEFAULT_SHARD_BYTES
    val_fraction: float = 0.0
    seed: int = 0
    follow_symlinks: bool = False


def _job_digest(src: Path, settings: PackSettings, splits: dict[str, list[Entry]],
                skipped: list[dict]) -> str:
    h = hashlib.sha256(json.dumps([str(src), settings.shard_bytes, settings.val_fraction,
                                   settings.seed, settings.follow_symlinks, skipped]).encode())
    for s in SPLITS:
        for e in splits[s]:
            h.update(json.dumps([s, e.rel, e.file.size, _mtime_ns(e.file), e.label]).encode())
    return "sha256:" + h.hexdigest()


def _mtime_ns(f: InputFile) -> int:
    """When ``f`` was last modified: an input edited in place (same size) is another job."""
    try:
        return os.stat(f.real).st_mtime_ns
    except OSError:
        return -1  # gone: reading it will skip it, and say why


def _refuse_foreign(split_dir: Path, resumed: bool) -> None:
    """Refuse a split folder holding files this job did not write (another dataset's shards
    and manifest, which packing would delete or replace)."""
    try:
        names = sorted(p.name for p in split_dir.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return  # nothing there yet (a file is make_out_dir's error)
    except OSError as e:
        raise DataError(f"cannot list {str(split_dir)!r}: {e.strerror}") from None
    ours = _OURS if resumed else _LEFTOVER
    foreign = [n for n in names if not ours.fullmatch(n)]
    if foreign:
        raise DataError(f"{str(split_dir)!r} already holds files this pack did not write "
                        f"({', '.join(map(repr, foreign[:3]))}"
                        f"{', ...' if len(foreign) > 3 else ''})",
                        expected="an empty or new output directory",
                        hint="pack into a new directory or delete this one")


def _read_json(path: Path) -> dict:
    """A state or manifest file of an earlier run ({} when it is unreadable or not an object)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _tar_bytes(size: int) -> int:
    return 512 + -(-size // 512) * 512


def _read_image(f: InputFile) -> tuple[bytes | None, str]:
    """(the file's bytes, its shard extension); (None, why) when it is unreadable or no image."""
    try:
        with f.open() as fh:
            data = fh.read()
    except DataError as e:
        return None, f"unreadable ({e.what})"
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"
    ext = image_ext(data[:HEAD_BYTES])
    if ext is None:
        return None, f"not an image (its first bytes are {data[:8]!r})"
    return data, ext


class _ShardWriter:
    """One tar shard being written: members, per-class counts, the estimated size."""

    def __init__(self, out: Path, index: int, n_classes: int):
        self.out, self.stem = out, f"shard-{index:06d}"
        # Closed by finish(); an interrupted pack leaves the .tmp, which the next run deletes.
        self.tar = tarfile.open(  # noqa: SIM115
            out / f"{self.stem}.tar.tmp", "w", format=tarfile.PAX_FORMAT)
        self.keys: list[str] = []
        self.class_counts = [0] * n_classes
        self.bytes = 0

    def add(self, key: str, ext: str, data: bytes, label: int) -> None:
        cls = str(label).encode()
        for name, blob in ((f"{key}.{ext}", data), (f"{key}.cls", cls)):
            self.tar.addfile(tar_member(name, len(blob)), io.BytesIO(blob))
            self.bytes += _tar_bytes(len(blob))
        self.keys.append(key)
        self.class_counts[label] += 1

    def finish(self, end: int) -> dict:
        self.tar.close()
        entry = finish_tar(self.out, self.stem, self.keys)
        return {**entry, "class_counts": self.class_counts, "end": end}


def _good_prefix(out: Path, shards: list[dict]) -> list[dict]:
    """The finished shards of an interrupted pack whose files still match their checksums."""
    kept = []
    for s in shards:
        if not all((out / s[k]).is_file() and file_checksum(out / s[k]) == s[c]
                   for k, c in (("tar", "checksum"), ("idx", "idx_checksum"))):
            break
        kept.append(s)
    return kept


def pack_images(src: str | Path, out: str | Path, settings: PackSettings = PackSettings(),
                progress: bool = False, stop_after_shards: int | None = None,
                readers: int = DEFAULT_READERS) -> Path:
    """Pack an image folder or table into ``out/train`` and ``out/val``; the manifest path.

    ``readers``: threads reading input files ahead (a shared file system serves many small
    reads at once far faster than one after the other); the output does not depend on it.
    ``stop_after_shards`` raises KeyboardInterrupt once that many shards are finished in this
    call: the seam the tests use to interrupt a pack.
    """
    src, out = Path(src), Path(out)
    if settings.shard_bytes < 1:
        raise ConfigError(f"shard size {settings.shard_bytes} bytes must be >= 1")
    if not 0 <= settings.val_fraction < 1:
        raise ConfigError(f"--val-fraction {settings.val_fraction}", expected="0 <= F < 1")
    skipped: list[dict] = []
    if src.is_dir():
        entries = from_folder(src, out, settings.follow_symlinks, skipped)
    elif src.is_file() and suffix(src) in TABLE_SUFFIXES:
        entries = from_table(src, settings.follow_symlinks, skipped)
    else:
        raise DataError(f"{str(src)!r} is neither a folder nor a table",
                        expected=f"an ImageFolder directory or a {'/'.join(TABLE_SUFFIXES)} "
                        "file of path,label rows", hint=PACK_IMAGES_HINT)
    if not entries:
        raise DataError(f"{str(src)!r} holds no image files", hint=PACK_IMAGES_HINT)
    splits = assign_splits(entries, settings.val_fraction, settings.seed)
    classes = class_names(entries)
    index = {c: i for i, c in enumerate(classes)}
    job = _job_digest(src, settings, splits, skipped)

    make_out_dir(out)
    final, partial = out / MANIFEST, out / PARTIAL
    if final.is_file():
        if _read_json(final).get("job") == job:
            partial.unlink(missing_ok=True)  # a run killed just after its manifest
            return final  # already packed
        raise DataError(f"{str(out)!r} already holds a different pack",
                        hint="pack into a new directory or delete this one")
    state = {"job": job, "splits": {}}
    if partial.is_file():
        state = _read_json(partial)
        if state.get("job") != job:
            raise DataError(f"{str(out)!r} holds an interrupted pack of other inputs or "
                            "settings (or an unreadable pack.partial.json)",
                            hint="pack into a new directory or delete this one")
        state.setdefault("splits", {})
    for split in SPLITS:
        _refuse_foreign(out / split, resumed=partial.is_file())
    stop = {"n": 0}

    def checkpoint() -> None:
        atomic_write_json(partial, state)
        fsync_dir(out)
        stop["n"] += 1
        if stop_after_shards is not None and stop["n"] >= stop_after_shards:
            raise KeyboardInterrupt(f"stopped after {stop['n']} shards (test seam)")

    todo = sum(e.file.size for s in SPLITS for e in splits[s])
    with BytesProgress(progress, todo, "pack-images") as bar:
        for split in SPLITS:
            if splits[split]:
                _pack_split(out / split, split, splits[split], index, settings, state, bar,
                            checkpoint, readers)
    for s in SPLITS:
        skipped += state["splits"].get(s, {}).get("skipped", [])
    summary = {}
    for split in SPLITS:
        if not splits[split]:
            shutil.rmtree(out / split, ignore_errors=True)
            continue
        shards = [{k: v for k, v in s.items() if k != "end"}
                  for s in state["splits"][split]["shards"]]
        counts = [sum(s["class_counts"][c] for s in shards) for c in range(len(classes))]
        n = sum(s["samples"] for s in shards)
        if n == 0:
            raise DataError(f"the {split} split of {str(src)!r} holds no readable images "
                            f"({len(skipped)} files skipped)", hint="see the warnings above")
        atomic_write_json(out / split / MANIFEST, {
            "format": TAR_FORMAT, "version": TAR_VERSION, "source": str(src), "split": split,
            "classes": classes, "class_counts": counts, "samples": n, "shards": shards})
        fsync_dir(out / split)
        summary[split] = {"samples": n, "shards": len(shards), "class_counts": counts,
                          "bytes": sum(s["bytes"] for s in shards),
                          "manifest_checksum": file_checksum(out / split / MANIFEST)}
    atomic_write_json(final, {
        "format": IMAGES_FORMAT, "version": IMAGES_VERSION, "source": str(src), "job": job,
        "classes": classes, "splits": summary, "skipped": skipped,
        "settings": {"shard_bytes": settings.shard_bytes, "val_fraction": settings.val_fraction,
                     "seed": settings.seed}})
    partial.unlink(missing_ok=True)
    fsync_dir(out)
    return final


def _read_ahead(files: list[InputFile], readers: int):
    """`_read_image` of each file, in order, read by ``readers`` threads a bounded way ahead."""
    if readers <= 1:
        yield from map(_read_image, files)
        return
    window = 4 * readers
    with ThreadPoolExecutor(readers, thread_name_prefix="hpctrain-pack") as pool:
        for lo in range(0, len(files), window):
            yield from pool.map(_read_image, files[lo:lo + window])


def _pack_split(out: Path, split: str, entries: list[Entry], index: dict[str, int],
                settings: PackSettings, state: dict, bar: BytesProgress, checkpoint,
                readers: int) -> None:
    """Write (or finish writing) one split's shards; ``state`` records them as they finish."""
    make_out_dir(out)
    mine = state["splits"].setdefault(split, {"shards": [], "skipped": []})
    mine["shards"] = _good_prefix(out, mine["shards"])
    start = mine["shards"][-1]["end"] if mine["shards"] else 0
    if start == len(entries):
        return
    mine["skipped"] = [s for s in mine["skipped"] if s["entry"] < start]
    names = {s[k] for s in mine["shards"] for k in ("tar", "idx")}
    for stale in out.glob("shard-*"):
        if stale.name not in names and _OURS.fullmatch(stale.name):
            stale.unlink()
    bar.advance(sum(e.file.size for e in entries[:start]))
    keys = tar_keys(entries)
    writer: _ShardWriter | None = None
    reads = _read_ahead([e.file for e in entries[start:]], readers)
    for i, (data, ext) in enumerate(reads, start=start):
        e = entries[i]
        bar.advance(e.file.size)
        if data is None:
            log.warning("skipping %r: %s", e.rel, ext)
            mine["skipped"].append({"path": e.rel, "why": ext, "entry": i})
            continue
        size = _tar_bytes(len(data)) + _tar_bytes(len(str(index[e.label])))
        if writer is not None and writer.bytes + size > settings.shard_bytes:
            mine["shards"].append(writer.finish(end=i))
            writer = None
            checkpoint()
        if writer is None:
            writer = _ShardWriter(out, len(mine["shards"]), len(index))
        writer.add(keys[i], ext, data, index[e.label])
    if writer is not None:
        mine["shards"].append(writer.finish(end=len(entries)))
        checkpoint()


def verify_images(root: str | Path) -> dict:
    """Check every split's shards (checksums) and counts against the manifests; the manifest."""
    root = Path(root)
    raw = read_manifest(root)
    if raw.get("format") != IMAGES_FORMAT or raw.get("version") != IMAGES_VERSION:
        raise DataError(f"{str(root / MANIFEST)!r} is not a version-{IMAGES_VERSION} image "
                        "manifest", hint=PACK_IMAGES_HINT)
    for split, want in (raw.get("splits") or {}).items():
        if split not in SPLITS:
            raise DataError(f"{str(root / MANIFEST)!r} lists a split {split!r}",
                            expected="train or val")
        got = file_checksum(root / split / MANIFEST) if (root / split / MANIFEST).is_file() \
            else "missing"
        if got != want.get("manifest_checksum"):
            raise DataError(f"{str(root / split / MANIFEST)!r} does not match the top manifest "
                            f"({got})", hint="pack the images again")
        load_tar_manifest(root / split)
        verify_tar(root / split)
    return raw
