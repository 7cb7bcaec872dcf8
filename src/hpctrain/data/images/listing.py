"""The images to pack and their classes: from an ImageFolder tree or a path,label table.

Found as for text (`hpctrain.data.inputs`); see `hpctrain.data.images.pack` for the rules. The
splits, the class order and the tar keys are decided here, deterministically.
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hpctrain.data.inputs import InputFile, read_documents, suffix, vet_file, walk_tree
from hpctrain.errors import ConfigError, DataError

log = logging.getLogger("hpctrain.data")

SPLITS = ("train", "val")
TABLE_SUFFIXES = (".csv", ".parquet", ".jsonl")
_INT = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Entry:
    """An input image: where it was found, its file, its class and its split (if given)."""

    rel: str  # path below the source folder: the sample's key and its name in messages
    file: InputFile
    label: str
    split: str | None


def _skip(skipped: list[dict], rel: str, why: str) -> None:
    """Warn that ``rel`` is left out, and why; note it in ``skipped`` (for the manifest)."""
    log.warning("skipping %r: %s", rel, why)
    skipped.append({"path": rel, "why": why})


def from_folder(src: Path, out: Path, follow: bool, skipped: list[dict]) -> list[Entry]:
    """The images of an ImageFolder tree (``CLASS/...`` or ``train|val/CLASS/...``)."""
    files = walk_tree(src, follow_symlinks=follow, exclude={Path(os.path.realpath(out))})
    tops = {rel.split("/", 1)[0] for rel, _ in files if "/" in rel}
    by_folder = "train" in tops and tops <= set(SPLITS)
    entries = []
    for rel, f in files:
        parts = rel.split("/")
        if len(parts) < (3 if by_folder else 2):
            _skip(skipped, rel, "not inside a class folder ("
                 + ("train/CLASS/FILE" if by_folder else "CLASS/FILE") + ")")
            continue
        split, label = (parts[0], parts[1]) if by_folder else (None, parts[0])
        entries.append(Entry(rel, f, label, split))
    return entries


def _table_rows(table: Path) -> list[dict]:
    if suffix(table) == ".csv":
        try:
            with vet_file(table).open() as raw, io.TextIOWrapper(raw, encoding="utf-8",
                                                                newline="") as text:
                return list(csv.DictReader(text))
        except (OSError, UnicodeDecodeError, csv.Error) as e:
            raise DataError(f"cannot read the table {str(table)!r}: {e}") from None
    return list(read_documents(table, field=None))


def from_table(table: Path, follow: bool, skipped: list[dict]) -> list[Entry]:
    """The images a path,label[,split] table names, relative to its folder."""
    base = table.parent
    base_real = Path(os.path.realpath(base))
    entries = []
    for n, row in enumerate(_table_rows(table), start=2 if suffix(table) == ".csv" else 1):
        where = f"{table}, row {n}"
        if not isinstance(row, dict) or row.get("path") in (None, "") or row.get(
                "label") in (None, ""):
            raise DataError(f"{where} has no path or no label ({row!r:.200})",
                            expected="columns path and label (and optionally split)")
        rel = os.path.normpath(str(row["path"]))
        if os.path.isabs(rel) or rel == ".." or rel.startswith("../"):
            raise DataError(f"{where}: path {row['path']!r} leaves the table's folder "
                            f"{str(base)!r}", expected="paths relative to the table's folder, "
                            "inside it", hint="move the table to the images' common folder")
        split = row.get("split") or None
        if split is not None and split not in SPLITS:
            raise DataError(f"{where}: split {split!r}", expected="train or val")
        # Resolved once: the path checked is the path vetted and read (a link swapped in
        # between cannot lead outside the folder).
        real = Path(os.path.realpath(base / rel))
        if not follow and not real.is_relative_to(base_real):
            _skip(skipped, rel, f"a symbolic link to {str(real)!r}, outside the "
                  "table's folder (pass --follow-symlinks to read it)")
            continue
        try:
            f = vet_file(real)
        except DataError as e:
            _skip(skipped, rel, f"unreadable ({e.what})")
            continue
        if f.real != real:
            _skip(skipped, rel, "unreadable (it changed while it was listed)")
            continue
        entries.append(Entry(rel, f, str(row["label"]).strip(), split))
    return entries


def _rank(seed: int, rel: str) -> tuple[str, str]:
    """A pseudo-random but fixed position for ``rel`` (ties broken by the path)."""
    return hashlib.sha256(f"{seed}\0{rel}".encode()).hexdigest(), rel


def assign_splits(entries: list[Entry], val_fraction: float,
                  seed: int) -> dict[str, list[Entry]]:
    """Each split's entries, in their (seeded, shuffled) shard order."""
    given = any(e.split for e in entries)
    if given and val_fraction > 0:
        raise ConfigError(f"--val-fraction {val_fraction} and splits given by the input "
                          "(train/ and val/ folders, or a split column)",
                          hint="use one of the two")
    splits: dict[str, list[Entry]] = {s: [] for s in SPLITS}
    if given or val_fraction <= 0:
        for e in entries:
            splits[e.split or "train"].append(e)
    else:
        by_class: dict[str, list[Entry]] = {}
        for e in entries:
            by_class.setdefault(e.label, []).append(e)
        for members in by_class.values():
            members.sort(key=lambda e: _rank(seed, e.rel))
            n_val = round(len(members) * val_fraction)
            splits["val"] += members[:n_val]
            splits["train"] += members[n_val:]
    for s in SPLITS:  # the shard order: shuffled once, so every shard mixes the classes
        splits[s].sort(key=lambda e: _rank(seed, e.rel))
    return splits


def class_names(entries: list[Entry]) -> list[str]:
    """The sorted class names (as numbers when all are integers); a label is an index here."""
    names = {e.label for e in entries}
    if all(_INT.fullmatch(n) for n in names):
        return sorted(names, key=int)
    return sorted(names)


def tar_keys(entries: list[Entry]) -> list[str]:
    """Tar keys: the path without its suffix, dots made ``_`` (WebDataset's key ends at the
    basename's first dot), made unique with ``_2``, ``_3``... in entry order."""
    used: set[str] = set()
    keys = []
    for e in entries:
        head, _, name = e.rel.rpartition("/")
        stem = name.rsplit(".", 1)[0] if "." in name[1:] else name
        key = (f"{head}/" if head else "") + (stem.replace(".", "_") or "_")
        cand, n = key, 1
        while cand in used:
            n += 1
            cand = f"{key}_{n}"
        used.add(cand)
        keys.append(cand)
    return keys
