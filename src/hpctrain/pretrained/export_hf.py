"""``hpctrain export hf RUN [--step N] --out DIR``: a checkpoint as a Hugging Face model folder.

    DIR/config.json                        the imported model's, or a LlamaForCausalLM config
    DIR/model.safetensors                  or model-0000i-of-0000n.safetensors + the index
    DIR/tokenizer.json ...                 the tokenizer files the model knows (see source.py):
                                           the imported folder's, or the data tokenizer's;
                                           none for byte-level tokens (the CLI says so)

Any training layout exports: DCP reads each tensor whole from however many shards the ranks
wrote, one tensor at a time, which is cast, put back into Hugging Face's q/k row order and
streamed into the current safetensors file. So the whole model is never in memory; the largest
tensor (the embedding) is. The folder is written under a temporary name beside ``--out`` and
renamed into place when complete; nothing is overwritten.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from hpctrain.checkpoint.safe_io import load_index
from hpctrain.data.chat import template_source
from hpctrain.data.tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON, HFTokenizer
from hpctrain.errors import ConfigError
from hpctrain.models.hf_weights import CONFIG, HFWeights, hf_mapping, write_safetensors
from hpctrain.models.init_source import ASSET_FILES
from hpctrain.parallel.data import DTYPES
from hpctrain.pretrained.source import ModelSource, data_tokenizer
from hpctrain.pretrained.weights import read_model_state, verify_checkpoint
from hpctrain.runtime.rundir import staged_dir, write_json_atomic

TORCH_NAMES = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}
DEFAULT_SHARD_BYTES = 5 * 10**9  # Hugging Face's own default shard size
# Copied beside the data tokenizer's tokenizer.json when it came from a model folder;
# tokenizer_config.json is written, not copied (the chat template and EOS are merged in).
_DATA_TOKENIZER_EXTRAS = ("special_tokens_map.json", "generation_config.json",
                          "tokenizer.model")


def export_hf(source: ModelSource, out: Path, dtype: str = "bf16",
              max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write ``source``'s model as a Hugging Face folder ``out``; returns it."""
    out = Path(out)
    if out.exists():
        raise ConfigError(f"--out {str(out)!r} already exists",
                          hint="name a new directory (nothing is overwritten)")
    args = source.origin.args
    hf = hf_mapping(args)
    fetch = _full_tensor_reader(source)
    shapes = hf.shapes(args)
    entries = [(hf.to_hf(name), DTYPES[dtype], shape) for name, shape in shapes.items()]
    names = {hf.to_hf(name): name for name in shapes}

    def hf_tensor(hf_name: str) -> torch.Tensor:
        name = names[hf_name]
        t = fetch(name)
        heads = hf.permuted_heads(name, args)
        return hf.to_hf_rows(t, heads) if heads is not None else t

    with staged_dir(out) as tmp:
        write_safetensors(tmp, entries, hf_tensor, max_shard_bytes)
        token_ids = _copy_tokenizer(source, tmp)
        write_json_atomic(tmp / CONFIG, hf.config_from_args(args, source.origin.hf_config,
                                                           TORCH_NAMES[dtype], token_ids))
    return out


def _full_tensor_reader(source: ModelSource):
    """``name -> whole tensor`` for the source's weights, one tensor per call."""
    args = source.origin.args
    if source.weights.kind == "hf":
        reader = HFWeights(source.weights.path, args)
        return reader.read_full
    path = source.weights.path
    manifest = verify_checkpoint(path)
    index = load_index(path / ".metadata", manifest["files"]).state_dict_metadata
    shapes = hf_mapping(args).shapes(args)

    def fetch(name: str) -> torch.Tensor:
        meta = index.get(f"model.{name}")
        if meta is None or not hasattr(meta, "size") or tuple(meta.size) != shapes[name]:
            raise ConfigError(f"{path} holds no model tensor {name} of shape "
                              f"{list(shapes[name])}",
                              hint="the checkpoint is of another model than its run's config "
                              "describes")
        t = torch.empty(shapes[name], dtype=meta.properties.dtype)
        read_model_state(path, {name: t}, manifest["files"])
        return t

    return fetch


def _copy_tokenizer(source: ModelSource, out: Path) -> dict[str, Any]:
    """Copy the tokenizer files the model knows into ``out``; the token ids a new config.json
    needs (``eos_token_id``, ``bos_token_id``) when there is no imported one."""
    assets = source.origin.assets
    if assets is not None:
        for name in ASSET_FILES:
            if (assets / name).is_file():
                shutil.copyfile(assets / name, out / name)
        return {}
    tok = data_tokenizer(source.run) if source.run is not None else None
    if not tok or tok.get("kind") != "hf" or not tok.get("path"):
        return {}  # byte-level data or none known: no tokenizer files (missing_tokenizer says)
    path = Path(tok["path"])
    folder = path if path.is_dir() else path.parent
    loaded = HFTokenizer(str(path), tok.get("eos_token"))
    if loaded.hash != tok.get("hash"):
        raise ConfigError(f"the tokenizer {path} changed since the run's data was prepared",
                          hint="export it by hand, or prepare the data again")
    shutil.copyfile(folder / TOKENIZER_JSON if path.is_dir() else path, out / TOKENIZER_JSON)
    if path.is_dir():  # a model folder: its other files belong with its tokenizer.json
        for name in _DATA_TOKENIZER_EXTRAS:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, out / name)
    config = dict(loaded.config)
    config.setdefault("eos_token", loaded.eos_token)
    template = template_source(path)
    if template is not None:
        config["chat_template"] = template
    write_json_atomic(out / TOKENIZER_CONFIG, config)
    return {"eos_token_id": loaded.eos_id}


def missing_tokenizer(source: ModelSource) -> str:
    """Why an export of ``source`` holds no tokenizer files (the model knows none)."""
    if source.origin.assets is not None:
        return f"the model it was imported from ({source.origin.assets}) has no tokenizer files"
    tok = data_tokenizer(source.run) if source.run is not None else None
    if tok is not None and tok.get("kind") == "bytes":
        return ("the model was trained on byte-level tokens (id = UTF-8 byte, EOS 256), which "
                "have no Hugging Face tokenizer file")
    return ("the run's data records no tokenizer (it was not prepared with --tokenizer); add "
            "the tokenizer files to the folder by hand")
