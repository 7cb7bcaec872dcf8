"""Hostile or damaged inputs of the bring-your-own-model path are refused with a user error.

A Hugging Face folder, an import's manifest, a chat template and a masked shard directory are
files anyone with write access to a shared directory could have changed: an index that points
outside the folder, a truncated safetensors file, tensors the config does not describe, a
template that reaches for Python internals, loss masks that do not match their manifest.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.data.chat import ChatTemplate
from hpctrain.data.shards import load_manifest, write_shard
from hpctrain.errors import ConfigError, DataError, HpctrainError
from hpctrain.models import ModelArgs, Transformer
from hpctrain.models.config import origin as source_origin
from hpctrain.models.hf_weights import HFWeights, write_safetensors
from hpctrain.models.init_source import parse_init_from
from hpctrain.models.llama.hf_config import hf_config_from_args
from hpctrain.models.llama.hf_names import expected_shapes, to_hf_name

pytest.importorskip("safetensors")

ARGS = ModelArgs(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, vocab_size=40,
                 max_seq_len=32)


def _folder(root: Path, args: ModelArgs = ARGS, shard_bytes: int = 4000) -> Path:
    """An HF folder written from a random hpctrain model (config.json + safetensors)."""
    root.mkdir(parents=True, exist_ok=True)
    model = Transformer(args)
    params = dict(model.named_parameters())
    entries = [(to_hf_name(n), torch.float32, s) for n, s in expected_shapes(args).items()]
    back = {to_hf_name(n): n for n in expected_shapes(args)}
    write_safetensors(root, entries, lambda hf: params[back[hf]].detach(), shard_bytes)
    (root / "config.json").write_text(json.dumps(hf_config_from_args(args, None, "float32")))
    return root


def test_an_index_naming_files_outside_the_folder_is_refused(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m")
    first = sorted(folder.glob("model-*.safetensors"))[0]
    (tmp_path / "evil.safetensors").write_bytes(first.read_bytes())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    for bad in ("../evil.safetensors", "/etc/passwd", "config.json"):
        index["weight_map"]["model.norm.weight"] = bad
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(ConfigError, match="not a .safetensors file of the model folder"):
            HFWeights(folder, ARGS)


def test_a_damaged_safetensors_file_is_a_user_error(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m", shard_bytes=10**9)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        HFWeights(folder, ARGS)
    path.write_bytes(struct.pack("<Q", 10**12) + b"{}")  # a header size beyond the file
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        HFWeights(folder, ARGS)


def test_tensors_the_config_does_not_describe_are_refused_by_name(tmp_path: Path) -> None:
    folder = _folder(tmp_path / "m")
    bigger = _folder(tmp_path / "big", ModelArgs(**{**ARGS.__dict__, "n_layers": 2}))
    with pytest.raises(ConfigError, match="model.layers.1.") as e:
        HFWeights(bigger, ARGS)  # weights of 2 layers, a config of 1
    assert "no place for" in e.value.what
    with pytest.raises(ConfigError, match="says 2 layers, its weights hold 1"):
        HFWeights(folder, ModelArgs(**{**ARGS.__dict__, "n_layers": 2}))
    wide = ModelArgs(**{**ARGS.__dict__, "ffn_dim": 48})
    with pytest.raises(ConfigError, match="has shape"):
        HFWeights(folder, wide).read_full("layers.0.feed_forward.w1.weight")


def test_an_imports_manifest_is_checked_before_its_shape_is_used(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for bad in ({"dim": "16"}, {"dim": -1, "n_layers": 1}, ["not", "a", "dict"],
                {**ARGS.__dict__, "os": "system"}):
        (ckpt / "manifest.json").write_text(json.dumps({"model_args": bad}))
        with pytest.raises(ConfigError, match="model_args"):
            source_origin(parse_init_from(str(ckpt)))


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{% for m in messages %}{{ m.update({'role': 'x'}) }}{% endfor %}",
    "{{ raise_exception('no') }}",
])
def test_a_chat_template_runs_in_the_sandbox(template: str) -> None:
    with pytest.raises(DataError):
        ChatTemplate(template, {}).render([{"role": "user", "content": "hi"}], False)


def _masked_dir(root: Path) -> Path:
    root.mkdir()
    tokens = np.arange(20, dtype="<u2") % 7
    mask = (np.arange(20) % 3 == 0).astype(np.uint8)
    entry = write_shard(root, 0, tokens, np.array([0, 10]), mask)
    (root / "manifest.json").write_text(json.dumps({
        "format": "hpctrain-tokens", "version": 2, "dtype": "uint16", "vocab_size": 8,
        "eos_id": 0, "shards": [entry]}))
    return root


def _edit(root: Path, change) -> None:
    raw = json.loads((root / "manifest.json").read_text())
    change(raw)
    (root / "manifest.json").write_text(json.dumps(raw))


def test_mask_entries_must_match_the_manifest_version(tmp_path: Path) -> None:
    root = _masked_dir(tmp_path / "d")
    assert load_manifest(root).has_masks
    _edit(root, lambda raw: raw["shards"][0].update(mask="../../etc/passwd"))
    with pytest.raises(DataError, match="loss mask"):
        load_manifest(root)
    _edit(root, lambda raw: raw["shards"][0].pop("mask"))
    with pytest.raises(DataError, match="lacks a valid loss mask"):
        load_manifest(root)
    _edit(root, lambda raw: raw.update(version=1))
    load_manifest(root)  # version 1 without masks: fine
    _edit(root, lambda raw: raw["shards"][0].update(mask="shard-000000.mask"))
    with pytest.raises(DataError, match="lists a loss mask in a version-1 manifest"):
        load_manifest(root)
    _edit(root, lambda raw: raw.update(version=3))
    with pytest.raises(DataError, match="of a version this hpctrain reads"):
        load_manifest(root)


def test_verify_finds_a_changed_or_truncated_mask(tmp_path: Path) -> None:
    root = _masked_dir(tmp_path / "d")
    mask_path = root / "shard-000000.mask"
    good = mask_path.read_bytes()
    mask_path.write_bytes(b"\x02" + good[1:])  # a value no mask holds, checksum resealed
    from hpctrain.data.shards import file_checksum

    _edit(root, lambda raw: raw["shards"][0].update(mask_checksum=file_checksum(mask_path)))
    with pytest.raises(DataError, match="other than 0/1"):
        load_manifest(root).verify()
    mask_path.write_bytes(good[:-3])
    with pytest.raises(DataError, match="bytes for 20 tokens"):
        load_manifest(root).mask(0)


def test_init_from_names_what_it_needs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config.json"):
        parse_init_from(f"hf:{tmp_path}")
    with pytest.raises(ConfigError, match="neither hf:DIR nor a checkpoint"):
        parse_init_from(str(tmp_path))
    assert issubclass(ConfigError, HpctrainError)
