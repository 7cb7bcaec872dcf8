"""The token shard format: ``manifest.json`` + ``shard-NNNNNN.bin`` + ``shard-NNNNNN.idx``.

    DIR/manifest.json         format version, dtype, vocab size, tokenizer name + hash, EOS id,
                              and per shard: file names, token count, document count, checksums
    DIR/shard-000000.bin      4096-byte header, then little-endian uint16 or uint32 tokens
    DIR/shard-000000.idx      little-endian uint64 start offsets (in tokens, within the shard)
                              of the documents that begin in this shard

The ``.bin`` header is ``<8s I I Q Q``: magic ``HPCTOK01``, format version, dtype code (2 =
uint16, 4 = uint32, the item size), token count, document count; zero-padded to one 4 KiB page,
so ``np.memmap(path, dtype, mode="r", offset=4096)`` reads the tokens directly. Counts are 64-bit.
Checksums are SHA-256 of whole files (``"sha256:<hex>"``): hashlib's SHA-256 runs at ~660 MB/s
on this machine's CPU with no extra dependency. Documents are separated by the EOS id (each
document is followed by EOS) and may continue from one shard into the next.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from hpctrain.errors import DataError

FORMAT_VERSION = 1
MAGIC = b"HPCTOK01"
HEADER_BYTES = 4096
_HEADER = struct.Struct("<8sIIQQ")
MANIFEST = "manifest.json"
PARTIAL_MANIFEST = "manifest.partial.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
PREPARE_HINT = "run `hpctrain data prepare INPUT... --out DIR` and point data.path at DIR"


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
    tmp = path.with_name(path.name + ".tmp")
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
        for part in data_parts:
            buf = memoryview(part).cast("B") if isinstance(part, np.ndarray) else part
            h.update(buf)
            f.write(buf)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
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


def write_shard(out: Path, index: int, tokens: np.ndarray, doc_starts: np.ndarray) -> dict:
    """Write shard ``index`` (tokens already in the target dtype); return its manifest entry."""
    dtype = np.dtype(tokens.dtype).newbyteorder("<")
    tokens = np.ascontiguousarray(tokens, dtype=dtype)
    starts = np.ascontiguousarray(doc_starts, dtype="<u8")
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, dtype.itemsize, len(tokens), len(starts))
    header += b"\0" * (HEADER_BYTES - len(header))
    stem = shard_name(index)
    bin_sum = atomic_write(out / f"{stem}.bin", [header, tokens])
    idx_sum = atomic_write(out / f"{stem}.idx", [starts])
    return {"bin": f"{stem}.bin", "idx": f"{stem}.idx", "tokens": int(len(tokens)),
            "docs": int(len(starts)), "bin_checksum": bin_sum, "idx_checksum": idx_sum}


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

    def verify(self) -> None:
        """Recompute every file's checksum; raise DataError naming the first mismatch."""
        for s in self.shards:
            for kind in ("bin", "idx"):
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
    if raw.get("format") != "hpctrain-tokens" or raw.get("version") != FORMAT_VERSION:
        raise DataError(f"{str(path)!r} is not a version-{FORMAT_VERSION} hpctrain token manifest",
                        hint=PREPARE_HINT)
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
