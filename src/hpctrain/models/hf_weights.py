"""Hugging Face safetensors weights, read box by box and written tensor by tensor.

Names: ``model.layers.3.self_attn.q_proj.weight`` is hpctrain's ``layers.3.attention.wq.weight``
(`to_hpctrain_name`, `to_hf_name`). Hugging Face rotates the two halves of each head
(``rotate_half``), hpctrain (like Meta's checkpoints) adjacent channel pairs, so the rows of
q and k (weights and Qwen2's biases) are permuted within each head on the way in and back on
the way out; a permutation, so the round trip is exact.

`HFWeights` reads a folder (``model.safetensors``, or shards and ``model.safetensors.index.json``)
through ``safe_open(...).get_slice``: memory-mapped, and a caller asks for a box (offset and
size per dimension), the part of a parameter its rank holds, so no rank reads or holds the whole
model. `write_safetensors` writes shards from a stream of tensors, one tensor in memory at a
time, with the index when there is more than one shard.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpctrain.errors import ConfigError
from hpctrain.models.sizes import ModelArgs

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_GLOBAL = {"model.embed_tokens.weight": "tok_embeddings.weight",
           "model.norm.weight": "norm.weight", "lm_head.weight": "output.weight"}
_LAYER = {
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "input_layernorm.weight": "attention_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_GLOBAL_BACK = {v: k for k, v in _GLOBAL.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_OURS_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
# Derived buffers old transformers versions saved; recomputed, never read.
_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")
# safetensors dtype names <-> torch
DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def to_hpctrain_name(hf: str) -> str | None:
    """hpctrain's name for a Hugging Face tensor name, or None if it has none."""
    if hf in _GLOBAL:
        return _GLOBAL[hf]
    m = _HF_LAYER.fullmatch(hf)
    if m and m[2] in _LAYER:
        return f"layers.{int(m[1])}.{_LAYER[m[2]]}"
    return None


def to_hf_name(ours: str) -> str:
    """The Hugging Face name of an hpctrain parameter name."""
    if ours in _GLOBAL_BACK:
        return _GLOBAL_BACK[ours]
    m = _OURS_LAYER.fullmatch(ours)
    if not m or m[2] not in _LAYER_BACK:
        raise KeyError(f"{ours!r} has no Hugging Face name")
    return f"model.layers.{int(m[1])}.{_LAYER_BACK[m[2]]}"


def expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of ``Transformer(args)`` by hpctrain name (a tied output once, as the
    embedding), with its full shape."""
    d, q, kv, f = args.dim, args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, \
        args.ffn_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (args.vocab_size, d),
                                          "norm.weight": (d,)}
    if not args.tie_embeddings:
        shapes["output.weight"] = (args.vocab_size, d)
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes.update({p + "attention.wq.weight": (q, d), p + "attention.wk.weight": (kv, d),
                       p + "attention.wv.weight": (kv, d), p + "attention.wo.weight": (d, q),
                       p + "feed_forward.w1.weight": (f, d), p + "feed_forward.w3.weight": (f, d),
                       p + "feed_forward.w2.weight": (d, f), p + "attention_norm.weight": (d,),
                       p + "ffn_norm.weight": (d,)})
        if args.qkv_bias:
            shapes.update({p + "attention.wq.bias": (q,), p + "attention.wk.bias": (kv,),
                           p + "attention.wv.bias": (kv,)})
    return shapes


def rotary_heads(name: str, args: ModelArgs) -> int | None:
    """Heads whose rows are permuted between the two layouts (q and k), else None."""
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return args.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return args.n_kv_heads
    return None


def from_hf_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of ``heads`` whole heads from Hugging Face's half-split order to adjacent pairs."""
    hd = t.shape[0] // heads
    return t.reshape(heads, 2, hd // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


def to_hf_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of ``heads`` whole heads from adjacent pairs to Hugging Face's half-split order."""
    hd = t.shape[0] // heads
    return t.reshape(heads, hd // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)


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

    def __init__(self, folder: Path, args: ModelArgs):
        try:
            import safetensors  # noqa: F401
        except ImportError:
            raise ConfigError("reading Hugging Face weights needs the 'safetensors' package",
                              hint="pip install safetensors") from None
        self.folder = Path(folder)
        self.args = args
        files = weight_files(self.folder)
        # Before anything is sized from config.json (a hostile one may say 10**9 layers): the
        # files must hold as many layers as it says, and every tensor the shape it implies.
        # (Fewer layers than the files hold: the extra tensors are named below.)
        layers = {int(m[1]) for hf in files if (m := _HF_LAYER.fullmatch(hf))}
        if args.n_layers > len(layers):
            raise ConfigError(f"config.json of {str(self.folder)!r} says {args.n_layers} "
                              f"layers, its weights hold {len(layers)}",
                              hint="the weights and config.json do not match")
        self.shapes = expected_shapes(args)
        self._slots: dict[str, _Slot] = {}
        self._open: dict[Path, Any] = {}
        extra = []
        for hf, path in files.items():
            ours = to_hpctrain_name(hf)
            if ours is None:
                if not _DERIVED.fullmatch(hf):
                    extra.append(hf)
            elif ours in self.shapes:
                self._slots[ours] = _Slot(path, hf)
            elif not (ours == "output.weight" and args.tie_embeddings):
                extra.append(hf)  # a tied model's lm_head copy is the embedding: not read
        if extra:
            raise ConfigError(f"{str(self.folder)!r} holds tensors hpctrain's model has no "
                              f"place for: {', '.join(sorted(extra)[:5])}",
                              expected="exactly the tensors config.json describes",
                              hint="the weights and config.json do not match, or the model "
                              "has parts hpctrain does not compute")
        missing = sorted(set(self.shapes) - set(self._slots))
        if missing:
            raise ConfigError(f"{str(self.folder)!r} lacks {to_hf_name(missing[0])}"
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
        heads = rotary_heads(name, self.args)
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
            t = from_hf_rows(t, (hi - lo) // hd)[offset[0] - lo: offset[0] - lo + size[0]]
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
