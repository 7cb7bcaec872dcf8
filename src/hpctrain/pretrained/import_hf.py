"""``hpctrain import hf DIR --out CKPT``: a Hugging Face model folder as an hpctrain checkpoint.

The output is a checkpoint directory like a run's (DCP shards written by one rank, a manifest
with every file's size and xxh3), that ``model.init_from: CKPT`` loads into any layout; its
manifest also records the model's shape (``model_args``), its ``config.json`` (``hf_config``)
and the tokenizer files copied beside the shards (``assets``), so export writes them back:

    CKPT/.metadata  __0_0.distcp        the weights (DCP), in hpctrain's names and layout
    CKPT/tokenizer.json ...              the folder's tokenizer and generation files
    CKPT/manifest.json                   step 0, model_args, hf_config, assets, files

The conversion runs in one process and holds the model once in host memory, in the chosen
dtype (16 GB for an 8B model in bf16); ``model.init_from: hf:DIR`` skips it, each rank reading
its own part of the safetensors. Nothing is overwritten: the checkpoint is written under a
temporary name beside ``--out`` and renamed into place when complete.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from hpctrain.checkpoint.manifest import describe, write_manifest
from hpctrain.errors import ConfigError
from hpctrain.models.hf_weights import CONFIG, HFWeights, read_hf_config
from hpctrain.models.init_source import ASSET_FILES, args_to_json
from hpctrain.models.registry import family_for_hf
from hpctrain.parallel.data import DTYPES
from hpctrain.parallel.materialize import load_weights
from hpctrain.pretrained.weights import single_process
from hpctrain.runtime.rundir import staged_dir


def import_hf(folder: Path, out: Path, dtype: str = "bf16", family: str | None = None) -> Path:
    """Convert the Hugging Face model in ``folder`` into the checkpoint ``out`` of model family
    ``family`` (None: the family its architecture names); returns it."""
    folder, out = Path(folder), Path(out)
    if out.exists():
        raise ConfigError(f"--out {str(out)!r} already exists",
                          hint="name a new directory (nothing is overwritten)")
    raw = read_hf_config(folder)
    where = str(folder / CONFIG)
    chosen = family_for_hf(raw, where, family, asked_by="--family")
    args = chosen.hf.args_from_config(raw, where)
    reader = HFWeights(folder, args)
    model = chosen.build(args)
    model.to_empty(device="cpu")
    model.init_buffers()  # ties a tied output to the embedding again
    model.to(DTYPES[dtype])
    load_weights(model, reader.read)
    reader.close()
    with staged_dir(out) as tmp:
        with single_process():
            dcp.save({"model": get_model_state_dict(model)},
                     storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=True)
        assets = [name for name in ASSET_FILES if (folder / name).is_file()]
        for name in assets:
            shutil.copyfile(folder / name, tmp / name)
        files = {p.name: describe(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        write_manifest(tmp, files, {
            "step": 0, "source": "hf", "hf_folder": str(folder.resolve()), "dtype": dtype,
            "model_family": chosen.name, "model_args": args_to_json(args), "hf_config": raw,
            "assets": assets, "saved_at": time.time()})
    return out
