"""The token shard format: ``manifest.json`` + ``shard-NNNNNN.bin`` + ``shard-NNNNNN.idx``.

    DIR/manifest.json         format version, dtype, vocab size, tokenizer name + hash, EOS id,
                              and per shard: file names, token count, document count, checksums,
                              largest token id
    DIR/shard-000000.bin      4096-byte header, then little-endian uint16 or uint32 tokens
    DIR/shard-000000.idx      little-endian uint64 start offsets (in tokens, within the shard)
                              of the documents that begin in this shard
    DIR/shard-000000.mask     (manifest version 2 only) one byte per token, 1 where the loss
                              counts the token as a target (a fine-tuning example's response),
                              0 elsewhere (its prompt); no header, so it memory-maps directly

The ``.bin`` header is ``<8s I I Q Q``: magic ``HPCTOK01``, format version, dtype code (2 =
uint16, 4 = uint32, the item size), token count, document count; zero-padded to one 4 KiB page,
so ``np.memmap(path, dtype, mode="r", offset=4096)`` reads the tokens directly. Counts are 64-bit.
Checksums are SHA-256 of whole files (``"sha256:<hex>"``): hashlib's SHA-256 runs at ~660 MB/s
on this machine's CPU with no extra dependency. Documents are separated by the EOS id (each
document is followed by EOS) and may continue from one shard into the next.

A manifest is checked when loaded (it may come from anyone who can write the directory): EOS id
and every recorded largest id below ``vocab_size``, shard file names plain names inside the
directory. `check_token_ids` holds the shards against a model's vocabulary before training.

Manifest versions: 1 has no masks (every token counts); 2 lists a ``mask`` file with its checksum
and ``loss_tokens`` (the ones in it) per shard, every shard. Version 1 is still written for plain
text, so its bytes do not change; an hpctrain that knows only version 1 refuses version 2 rather
than train on prompts it should not.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.errors import DataError

log = logging.getLogger("hpctrain.data")

FORMAT_VERSION = 1  # of the .bin header, and of a manifest without masks
MASK_VERSION = 2  # a manifest whose shards carry loss masks
MANIFEST_VERSIONS = (FORMAT_VERSION, MASK_VERSION)
MAGIC = b"HPCTOK01"
HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sIIQQ")
MANIFEST = "manifest.json"
PARTIAL_MANIFEST = "manifest.partial.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
PREPARE_HINT = "run `hpctrain data prepare INPUT... --out DIR` and point data.path at DIR"
# Shard file names as written; anything else (``../x``, ``/etc/x``) is refused, since staging
# copies these names into another directory.
_SHARD_FILE = re.compile(r"shard-\d{6,}\.(bin|idx|mask)")


def shard_name(i: int) -> str:
    """File stem of shard ``i``."""
    return f"shard-{i:06d}"


def dtype_name(dtype: np.dtype) -> str:
    """``"uint16"`` or ``"uint32"``."""
    return {2: "uint16", 4: "uint32"}[np.dtype(dtype).itemsize]


def file_checksum(path: Path, chunk: int = 8 << 20) -> str:
    """``"sha256:<hex>"`` of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "sha256:" + h.hexdigest()


def atomic_write(path: Path, data_parts: list[bytes | memoryview | np.ndarray]) -> str:
    """Write ``path`` via a temporary name, fsync, rename; return the SHA-256 checksum."""
    # A random name created exclusively: a link planted in a shared data folder at a temp name
    # is never written through (O_EXCL fails on any existing name); mode 0o666 less the umask.
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
    h = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as f:
            for part in data_parts:
                buf = memoryview(part).cast("B") if isinstance(part, np.ndarray) else part
                h.update(buf)
                f.write(buf)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return "sha256:" + h.hexdigest()


def make_out_dir(path: Path) -> Path:
    """Create the output directory ``path`` and its parents; an existing file is an error."""
    if path.exists() and not path.is_dir():
        raise DataError(f"output path {str(path)!r} exists and is not a directory",
                        hint="name a new or an existing directory with --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create output directory {str(path)!r}: {e.strerror}",
                        hint="name a directory you can write with --out") from None
    return path


def atomic_write_json(path: Path, obj: Any) -> None:
    """Write JSON (sorted keys, so byte-identical for equal content) atomically."""
    atomic_write(path, [(json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()])


def write_shard(out: Path, index: int, tokens: np.ndarray, doc_starts: np.ndarray,
                mask: np.ndarray | None = None) -> dict:
    """Write shard ``index`` (tokens already in the target dtype, and its loss mask if any);
    return its manifest entry."""
    dtype = np.dtype(tokens.dtype).newbyteorder("<")
    tokens = np.ascontiguousarray(tokens, dtype=dtype)
    starts = np.ascontiguousarray(doc_starts, dtype="<u8")
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, dtype.itemsize, len(tokens), len(starts))
    header += b"\0" * (HEADER_BYTES - len(header))
    stem = shard_name(index)
    bin_sum = atomic_write(out / f"{stem}.bin", [header, tokens])
    idx_sum = atomic_write(out / f"{stem}.idx", [starts])
    entry = {"bin": f"{stem}.bin", "idx": f"{stem}.idx", "tokens": int(len(tokens)),
             "docs": int(len(starts)), "bin_checksum": bin_sum, "idx_checksum": idx_sum,
             "max_token_id": int(tokens.max()) if len(tokens) else -1}
    if mask is not None:
        mask = np.ascontiguousarray(mask, dtype=np.uint8)
        if len(mask) != len(tokens) or int(mask.max(initial=0)) > 1:
            raise ValueError("a loss mask holds one 0/1 byte per token")
        entry.update(mask=f"{stem}.mask", mask_checksum=atomic_write(out / f"{stem}.mask",
                                                                      [mask]),
                     loss_tokens=int(mask.sum()))
    return entry


def read_header(path: Path) -> tuple[int, np.dtype, int, int]:
    """(version, dtype, token count, document count) from a ``.bin`` header."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_HEADER.size)
    except OSError as e:
        raise DataError(f"cannot read shard {str(path)!r}: {e.strerror}",
                        hint=PREPARE_HINT) from None
    if len(raw) < _HEADER.size:
        raise DataError(f"shard {str(path)!r} is truncated ({len(raw)} bytes, no header)")
    magic, version, code, ntok, ndoc = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise DataError(f"shard {str(path)!r} does not start with {MAGIC!r} (found {magic!r})",
                        expected="a .bin written by hpctrain data prepare")
    if version != FORMAT_VERSION or code not in (2, 4):
        raise DataError(f"shard {str(path)!r} has format version {version}, dtype code {code}",
                        expected=f"version {FORMAT_VERSION}, dtype code 2 or 4")
    return version, np.dtype("<u2" if code == 2 else "<u4"), ntok, ndoc


@dataclass(frozen=True)
class Manifest:
    """A prepared token directory, as described by its ``manifest.json``."""

    root: Path
    raw: dict

    @property
    def dtype(self) -> np.dtype:
        """Token dtype on disk."""
        return DTYPES[self.raw["dtype"]]

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer produces, EOS included."""
        return int(self.raw["vocab_size"])

    @property
    def eos_id(self) -> int:
        """The id that follows every document."""
        return int(self.raw["eos_id"])

    @property
    def shards(self) -> list[dict]:
        """Per-shard entries in order."""
        return self.raw["shards"]

    @property
    def num_tokens(self) -> int:
        """Tokens over all shards."""
        return sum(int(s["tokens"]) for s in self.shards)

    @property
    def has_masks(self) -> bool:
        """Whether the shards carry loss masks (manifest version 2)."""
        return self.raw["version"] == MASK_VERSION

    def mask(self, i: int) -> np.ndarray:
        """Shard ``i``'s loss mask (one 0/1 byte per token), memory-mapped read-only."""
        s = self.shards[i]
        path = self.root / s["mask"]
        ntok = int(s["tokens"])
        try:
            size = path.stat().st_size
        except OSError as e:
            raise DataError(f"cannot read loss mask {str(path)!r}: {e.strerror}",
                            hint=PREPARE_HINT) from None
        if size != ntok:
            raise DataError(f"loss mask {str(path)!r} is {size} bytes for {ntok} tokens",
                            hint="prepare the data again")
        if ntok == 0:
            return np.zeros(0, dtype=np.uint8)
        return np.memmap(path, dtype=np.uint8, mode="r", shape=(ntok,))

    def tokens(self, i: int) -> np.ndarray:
        """Shard ``i``'s tokens, memory-mapped read-only."""
        s = self.shards[i]
        path = self.root / s["bin"]
        _, dtype, ntok, _ = read_header(path)
        if ntok != int(s["tokens"]) or dtype != self.dtype:
            raise DataError(
                f"shard {str(path)!r} header says {ntok} {dtype_name(dtype)} tokens, the manifest "
                f"{s['tokens']} {self.raw['dtype']}", hint="the directory mixes two preparations; "
                "prepare it again into an empty directory")
        expected = HEADER_BYTES + ntok * dtype.itemsize
        if path.stat().st_size != expected:
            raise DataError(f"shard {str(path)!r} is truncated or padded: "
                            f"{path.stat().st_size} bytes, expected {expected}",
                            hint="prepare the data again")
        if ntok == 0:
            return np.zeros(0, dtype=dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(ntok,))

    def doc_starts(self, i: int) -> np.ndarray:
        """Shard ``i``'s document start offsets."""
        path = self.root / self.shards[i]["idx"]
        return np.fromfile(path, dtype="<u8")

    def max_token_id(self, i: int) -> int:
        """Largest token id in shard ``i`` (-1 when empty): recorded, or found by a scan.

        Manifests written before the maximum was recorded are scanned (np.max over the memmap,
        once per process and shard version) rather than refused: they came from our own prepare,
        and preparing a large corpus again costs far more than reading it once at disk speed.
        """
        recorded = self.shards[i].get("max_token_id")
        if recorded is not None:
            return int(recorded)
        path = self.root / self.shards[i]["bin"]
        st = path.stat()
        key = (path, st.st_mtime_ns, st.st_size)
        if key not in _scanned:
            tokens = self.tokens(i)
            _scanned[key] = int(tokens.max()) if len(tokens) else -1
        return _scanned[key]

    def verify(self) -> None:
        """Recompute every file's checksum and largest id; raise DataError at the first mismatch."""
        for i, s in enumerate(self.shards):
            for kind in ("bin", "idx", "mask") if self.has_masks else ("bin", "idx"):
                path = self.root / s[kind]
                if not path.is_file():
                    raise DataError(f"shard file {str(path)!r} listed in the manifest is missing",
                                    hint=PREPARE_HINT)
                got = file_checksum(path)
                if got != s[f"{kind}_checksum"]:
                    raise DataError(
                        f"checksum mismatch in shard {str(path)!r}: manifest has "
                        f"{s[f'{kind}_checksum']}, file has {got}",
                        expected="the bytes written by hpctrain data prepare",
                        hint="the file is corrupted or was changed; prepare the data again",
                    )
            tokens = self.tokens(i)
            largest = int(tokens.max()) if len(tokens) else -1
            recorded = s.get("max_token_id", largest)
            if largest != recorded or largest >= self.vocab_size:
                raise DataError(
                    f"shard {str(self.root / s['bin'])!r}: the manifest records largest token id "
                    f"{recorded}, the shard holds {largest} (vocab_size {self.vocab_size})",
                    expected="the largest id written by hpctrain data prepare, below vocab_size",
                    hint="the manifest or shard was changed; prepare the data again")
            if self.has_masks:
                mask = self.mask(i)
                ones = int(np.count_nonzero(mask))
                if int(mask.max(initial=0)) > 1 or ones != s["loss_tokens"]:
                    raise DataError(f"loss mask {str(self.root / s['mask'])!r} holds values "
                                    f"other than 0/1 or {ones} ones, the manifest says "
                                    f"{s['loss_tokens']}", hint="prepare the data again")


# (path, mtime_ns, size) of shards scanned for their largest id in this process.
_scanned: dict[tuple[Path, int, int], int] = {}


def check_token_ids(m: Manifest, vocab_size: int | None = None) -> None:
    """Raise DataError naming the first shard with an id >= the manifest's or the model's
    ``vocab_size``."""
    legacy = sum("max_token_id" not in s for s in m.shards)
    if legacy:
        log.warning("%s: %d shards record no largest token id (prepared by an older hpctrain); "
                    "reading them to find it. Prepare the data again to skip this.", m.root,
                    legacy)
    for i, s in enumerate(m.shards):
        largest = m.max_token_id(i)
        path = str(m.root / s["bin"])
        if largest >= m.vocab_size:
            raise DataError(f"shard {path!r} holds token id {largest}, outside the vocab_size "
                            f"{m.vocab_size} of its manifest",
                            hint="the manifest or shard was changed; prepare the data again")
        if vocab_size is not None and largest >= vocab_size:
            raise DataError(
                f"shard {path!r} holds token id {largest}, but the model's vocabulary has "
                f"{vocab_size} ids (0..{vocab_size - 1})",
                expected="data prepared with the model's tokenizer",
                hint=f"set model.vocab_size >= {largest + 1}, or prepare the data with the "
                "tokenizer the model was built for")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_manifest(root: Path, raw: dict) -> None:
    """Refuse a manifest that contradicts itself or names files outside its directory."""
    path = str(root / MANIFEST)
    vocab, eos, shards = raw.get("vocab_size"), raw.get("eos_id"), raw.get("shards")
    if not _is_int(vocab) or vocab < 1 or raw.get("dtype") not in DTYPES:
        raise DataError(f"{path!r} has vocab_size {vocab!r}, dtype {raw.get('dtype')!r}",
                        expected="a positive integer vocab_size and dtype uint16 or uint32",
                        hint=PREPARE_HINT)
    if not _is_int(eos) or not 0 <= eos < vocab:
        raise DataError(f"{path!r}: EOS id {eos!r} does not fit vocab_size {vocab}",
                        expected="0 <= eos_id < vocab_size", hint=PREPARE_HINT)
    if not isinstance(shards, list) or not all(isinstance(s, dict) for s in shards):
        raise DataError(f"{path!r} lists no shards", hint=PREPARE_HINT)
    masked = raw.get("version") == MASK_VERSION
    for s in shards:
        if masked != ("mask" in s) or masked and not (
                isinstance(s.get("mask"), str) and _SHARD_FILE.fullmatch(s["mask"])
                and _is_int(s.get("loss_tokens")) and isinstance(s.get("mask_checksum"), str)):
            raise DataError(f"{path!r}: shard entry {s.get('bin')!r} "
                            + ("lacks a valid loss mask entry" if masked else
                               "lists a loss mask in a version-1 manifest"),
                            expected="masks on every shard (version 2) or on none (version 1)",
                            hint=PREPARE_HINT)
        names = (s.get("bin"), s.get("idx"))
        if not all(isinstance(n, str) and _SHARD_FILE.fullmatch(n) for n in names) or not _is_int(
                s.get("tokens")):
            raise DataError(f"{path!r} has a malformed shard entry (files {names!r})",
                            expected="files named shard-NNNNNN.bin / .idx in the same directory",
                            hint=PREPARE_HINT)
        largest = s.get("max_token_id")
        if largest is not None and (not _is_int(largest) or largest >= vocab):
            raise DataError(f"shard {str(root / names[0])!r}: largest token id {largest!r} does "
                            f"not fit vocab_size {vocab} of {path!r}",
                            expected="every token id below the manifest's vocab_size",
                            hint=PREPARE_HINT)


def load_manifest(root: str | Path) -> Manifest:
    """Read ``root/manifest.json`` (a finished preparation)."""
    root = Path(root)
    path = root / MANIFEST
    if not path.is_file():
        partial = (root / PARTIAL_MANIFEST).is_file()
        raise DataError(
            f"{str(path)!r} does not exist"
            + (" (a preparation was interrupted there)" if partial else ""),
            expected="a directory written by hpctrain data prepare",
            hint=("rerun the same `hpctrain data prepare` command to finish it" if partial
                  else PREPARE_HINT),
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {str(path)!r}: {e}", hint=PREPARE_HINT) from None
    if (not isinstance(raw, dict) or raw.get("format") != "hpctrain-tokens"
            or raw.get("version") not in MANIFEST_VERSIONS):
        raise DataError(f"{str(path)!r} is not an hpctrain token manifest of a version this "
                        f"hpctrain reads ({', '.join(map(str, MANIFEST_VERSIONS))})",
                        hint=PREPARE_HINT)
    _check_manifest(root, raw)
    return Manifest(root, raw)


@lru_cache(maxsize=16)
def _cached_vocab(root: str, mtime_ns: int) -> int:
    return load_manifest(root).vocab_size


def manifest_vocab_size(root: str | Path) -> int:
    """Vocabulary size recorded in a prepared directory (cached per manifest version)."""
    path = Path(root) / MANIFEST
    try:
        mtime = path.stat().st_mtime_ns
    except OSError:
        mtime = -1
    return _cached_vocab(str(root), mtime)
