"""Hugging Face model folders: ``config.json``, and safetensors weights read box by box and
written tensor by tensor.

`HFWeights` reads a folder (``model.safetensors``, or shards and ``model.safetensors.index.json``)
through ``safe_open(...).get_slice``: memory-mapped, and a caller asks for a box (offset and
size per dimension), the part of a parameter its rank holds, so no rank reads or holds the whole
model. Which tensor is which, and how its rows are laid out, is the model family's Hugging Face
mapping (``ModelFamily.hf``). `write_safetensors` writes shards from a stream of tensors, one
tensor in memory at a time, with the index when there is more than one shard.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpctrain.errors import ConfigError
from hpctrain.models.spec import HFMapping, ModelFamily

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# safetensors dtype names <-> torch
DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def read_hf_config(folder: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a Hugging Face model folder (ConfigError if unusable)."""
    path = Path(folder) / CONFIG
    if not Path(folder).is_dir():
        raise ConfigError(f"{str(folder)!r} is not a directory",
                          expected="a Hugging Face model folder (config.json + *.safetensors)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{str(path)!r} does not exist",
                          expected="a Hugging Face model folder (config.json + *.safetensors)",
                          hint="download the model with `huggingface-cli download ID "
                          "--local-dir DIR` on a machine with internet access") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{str(path)!r} cannot be read: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{str(path)!r} holds a JSON {type(raw).__name__}, not a config")
    return raw


def _family_of(args: Any) -> ModelFamily:
    """The registered family of shape ``args`` (imported late: the families import this module)."""
    from hpctrain.models.registry import family_of_args

    return family_of_args(args)


def hf_mapping(args: Any) -> HFMapping:
    """The Hugging Face mapping of the family of shape ``args`` (ConfigError if it has none)."""
    family = _family_of(args)
    if family.hf is None:
        raise ConfigError(f"model family {family.name!r} has no Hugging Face mapping",
                          expected="a family with import/export (see hpctrain.models.registry)")
    return family.hf


def _plain_file(folder: Path, name: object, where: Path) -> Path:
    if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", "..") \
            or not name.endswith(".safetensors"):
        raise ConfigError(f"{str(where)!r} names {name!r}, which is not a .safetensors file "
                          "of the model folder", hint="the index is damaged or hostile; "
                          "download the model again")
    path = folder / name
    if not path.is_file():
        raise ConfigError(f"{str(where)!r} names {name!r}, which does not exist in "
                          f"{str(folder)!r}", hint="the download is incomplete")
    return path


def weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it."""
    folder = Path(folder)
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, ValueError, AttributeError) as e:
            raise ConfigError(f"{str(index)!r} is not a safetensors index: {e}") from None
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{str(index)!r} has no weight_map",
                              expected='{"weight_map": {"<tensor>": "<file>.safetensors"}}')
        return {k: _plain_file(folder, f, index) for k, f in weight_map.items()}
    if (folder / SINGLE).is_file():
        return {name: folder / SINGLE for name in _header(folder / SINGLE)}
    raise ConfigError(f"{str(folder)!r} holds neither {SINGLE} nor {INDEX}",
                      expected="a Hugging Face model folder with safetensors weights",
                      hint="PyTorch .bin weights are not read (they run pickled code); convert "
                      "them to safetensors with transformers' save_pretrained")


def _header(path: Path) -> list[str]:
    """The tensor names of a safetensors file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())  # noqa: SIM118 - a safe_open handle is no dict
    except Exception as e:  # noqa: BLE001 - SafetensorError and OS errors: damaged file
        raise ConfigError(f"{str(path)!r} is not a readable safetensors file: {e}") from None


@dataclass
class _Slot:
    path: Path
    hf_name: str


class HFWeights:
    """The weights of a Hugging Face model folder, read in boxes by hpctrain parameter name."""

    def __init__(self, folder: Path, args: Any):
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise ConfigError("reading Hugging Face weights needs the 'safetensors' package",
                              hint="pip install safetensors") from None
        self.folder = Path(folder)
        self.args = args
        self.hf = hf = hf_mapping(args)
        files = weight_files(self.folder)
        # Before anything is sized from config.json (a hostile one may say 10**9 layers): the
        # files must hold as many blocks as it says, and every tensor the shape it implies.
        # (Fewer blocks than the files hold: the extra tensors are named below.)
        blocks = f"{_family_of(args).blocks}."
        held = {ours[len(blocks):].split(".", 1)[0] for name in files
                if (ours := hf.to_ours(name)) is not None and ours.startswith(blocks)}
        if args.n_layers > len(held):
            raise ConfigError(f"config.json of {str(self.folder)!r} says {args.n_layers} "
                              f"layers, its weights hold {len(held)}",
                              hint="the weights and config.json do not match")
        self.shapes = hf.shapes(args)
        self._slots: dict[str, _Slot] = {}
        self._open: dict[Path, Any] = {}
        extra = []
        for name, path in files.items():
            ours = hf.to_ours(name)
            if ours is None:
                if not hf.derived(name):
                    extra.append(name)
            elif ours in self.shapes:
                self._slots[ours] = _Slot(path, name)
            elif not (args.tie_embeddings and ours in hf.tied):
                extra.append(name)  # a tied model's output copy is the embedding: not read
        if extra:
            raise ConfigError(f"{str(self.folder)!r} holds tensors hpctrain's model has no "
                              f"place for: {', '.join(sorted(extra)[:5])}",
                              expected="exactly the tensors config.json describes",
                              hint="the weights and config.json do not match, or the model "
                              "has parts hpctrain does not compute")
        missing = sorted(set(self.shapes) - set(self._slots))
        if missing:
            raise ConfigError(f"{str(self.folder)!r} lacks {hf.to_hf(missing[0])}"
                              + (f" and {len(missing) - 1} more tensors" if len(missing) > 1
                                 else ""), hint="the download is incomplete")
        for name, slot in self._slots.items():
            self._check_shape(name, slot)
        self.bytes_read = 0  # what this reader copied out of the files (tests check it)

    def _check_shape(self, name: str, slot: _Slot) -> tuple[int, ...]:
        """The shape of ``name`` in its file (read from the header), refused unless it is the
        shape config.json implies."""
        try:
            full = tuple(self._handle(slot.path).get_slice(slot.hf_name).get_shape())
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - SafetensorError: a name the file lacks
            raise ConfigError(f"{slot.hf_name} cannot be read from {str(slot.path)!r}: "
                              f"{e}", hint="the index and the weights do not match") from None
        if full != self.shapes[name]:
            raise ConfigError(f"{slot.hf_name} in {str(slot.path)!r} has shape {list(full)}, "
                              f"config.json implies {list(self.shapes[name])}",
                              hint="the weights and config.json do not match")
        return full

    def _handle(self, path: Path) -> Any:
        from safetensors import safe_open

        if path not in self._open:
            try:
                self._open[path] = safe_open(str(path), framework="pt")
            except Exception as e:  # noqa: BLE001 - SafetensorError: damaged file
                raise ConfigError(f"{str(path)!r} is not a readable safetensors file: "
                                  f"{e}") from None
        return self._open[path]

    def read(self, name: str, offset: Iterable[int], size: Iterable[int]) -> torch.Tensor:
        """The box ``[offset, offset + size)`` of parameter ``name`` in hpctrain's layout."""
        slot = self._slots[name]
        full = self._check_shape(name, slot)
        sl = self._handle(slot.path).get_slice(slot.hf_name)
        offset, size = list(offset), list(size)
        heads = self.hf.permuted_heads(name, self.args)
        lo, hi = offset[0], offset[0] + size[0]
        if heads is not None:
            # Whole heads (the permutation stays inside a head), then the asked rows of them.
            hd = full[0] // heads
            lo, hi = lo // hd * hd, -(-hi // hd) * hd
        box = tuple([slice(lo, hi)] + [slice(o, o + s) for o, s in zip(offset[1:], size[1:],
                                                                      strict=True)])
        try:
            t = sl[box]
        except Exception as e:  # noqa: BLE001 - a truncated or damaged file
            raise ConfigError(f"{slot.hf_name} in {str(slot.path)!r} cannot be read: "
                              f"{e}") from None
        self.bytes_read += t.numel() * t.element_size()
        if heads is not None:
            t = self.hf.from_hf_rows(t, (hi - lo) // hd)[offset[0] - lo: offset[0] - lo + size[0]]
        return t

    def read_full(self, name: str) -> torch.Tensor:
        """Parameter ``name`` whole, in hpctrain's layout."""
        shape = self.shapes[name]
        return self.read(name, (0,) * len(shape), shape)

    def close(self) -> None:
        """Drop the open file handles (and their memory maps)."""
        self._open.clear()


def write_safetensors(out: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                      fetch: Callable[[str], torch.Tensor], max_shard_bytes: int,
                      metadata: dict[str, str] | None = None) -> list[Path]:
    """Write ``entries`` (name, dtype, shape) into safetensors files under ``out``.

    ``fetch(name)`` gives each tensor when its turn comes, so one tensor is in memory at a time.
    One file is ``model.safetensors``; more are ``model-0000i-of-0000n.safetensors`` plus
    ``model.safetensors.index.json``. Each file is written under a temporary name and renamed.
    """
    shards: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for entry in entries:
        nbytes = _nbytes(entry)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    n = len(shards)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                     for i in range(n)]
    written = []
    for name, shard in zip(names, shards, strict=True):
        written.append(_write_file(out / name, shard, fetch, metadata or {}))
    if n > 1:
        index = {"metadata": {"total_size": sum(_nbytes(e) for e in entries)},
                 "weight_map": {e[0]: name for name, shard in zip(names, shards, strict=True)
                                for e in shard}}
        tmp = out / f".{INDEX}.tmp"
        tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, out / INDEX)
        written.append(out / INDEX)
    return written


def _nbytes(entry: tuple[str, torch.dtype, tuple[int, ...]]) -> int:
    _, dtype, shape = entry
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()


def _write_file(path: Path, shard: list[tuple[str, torch.dtype, tuple[int, ...]]],
                fetch: Callable[[str], torch.Tensor], metadata: dict[str, str]) -> Path:
    """One safetensors file: header (offsets known from the shapes), then each tensor's bytes."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **metadata}}
    offset = 0
    for name, dtype, shape in shard:
        end = offset + _nbytes((name, dtype, shape))
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, dtype, shape in shard:
            t = fetch(name).to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"{name}: got shape {tuple(t.shape)}, planned {shape}")
            f.write(t.reshape(-1).view(torch.uint8).numpy())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
