"""Pretrained weights into a model: from a Hugging Face folder or an hpctrain checkpoint.

The trainer (any layout) calls `load_pretrained` once its model is sharded and materialised:
from a Hugging Face folder every rank reads the boxes of the parameters it holds from the
memory-mapped safetensors (`hpctrain.parallel.materialize.load_weights`); from a checkpoint
DCP reads and reshards, and the files are verified against the manifest first, split over
the ranks. The tools that work in one process (generate, eval, export) call `load_model`.
Nothing runs code from a checkpoint: its index and values are read as `safe_io` says.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from hpctrain.checkpoint.manifest import DamagedCheckpoint, read_manifest, verify_files
from hpctrain.checkpoint.safe_io import SafeFileSystemReader, SafeLoadPlanner
from hpctrain.models.config import origin as source_origin
from hpctrain.models.hf_weights import HFWeights
from hpctrain.models.init_source import InitSource, parse_init_from
from hpctrain.models.registry import family_of_args
from hpctrain.parallel.materialize import load_weights

log = logging.getLogger("hpctrain.pretrained")


def starts_from_pretrained(resume: str, has_checkpoints: bool) -> bool:
    """Whether a run loads its ``init_from`` weights: not when it resumes from a checkpoint
    (``checkpoint.resume`` a path, or ``auto`` with checkpoints in the run)."""
    return resume == "never" or (resume == "auto" and not has_checkpoints)


@contextlib.contextmanager
def single_process() -> Iterator[None]:
    """DCP in this process alone, without its warning that this is meant (it is)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check a checkpoint's manifest and every file's checksum (one process); its manifest."""
    manifest = read_manifest(path)
    verify_files(path, manifest["files"], sorted(manifest["files"]))
    return manifest


def read_model_state(path: Path, state: dict[str, torch.Tensor], files: dict[str, Any],
                     group: dist.ProcessGroup | None = None) -> None:
    """Fill ``state`` (model tensors by name, sharded or whole) in place from checkpoint
    ``path`` through DCP, resharding as needed; ``group=None`` reads in this process alone."""
    try:
        with single_process() if group is None else contextlib.nullcontext():
            dcp.load({"model": state}, storage_reader=SafeFileSystemReader(path, files=files),
                     planner=SafeLoadPlanner(), process_group=group, no_dist=group is None)
    except CheckpointException as e:  # a BaseException carrying each rank's failure
        inner = next(iter(e.failures.values()))[0] if e.failures else e
        if isinstance(inner, DamagedCheckpoint):
            raise DamagedCheckpoint(inner.what) from None
        first = (str(inner).strip().splitlines() or [""])[0]
        raise DamagedCheckpoint(
            f"the model weights of {path} do not load: {type(inner).__name__}: {first}",
            hint="is it a checkpoint of a model of this shape?") from None


def load_pretrained(model: torch.nn.Module, init_from: str, args: Any,
                    verify: Callable[[Path], dict[str, Any]],
                    group: dist.ProcessGroup | None) -> None:
    """Fill the (sharded, materialised) ``model`` from ``init_from``; collective over ``group``
    for a checkpoint (``verify`` checks it, split over the ranks), local for Hugging Face."""
    src = parse_init_from(init_from)
    start = time.perf_counter()
    if src.kind == "hf":
        reader = HFWeights(src.path, args)
        load_weights(model, reader.read)
        read = reader.bytes_read
        reader.close()
    else:
        manifest = verify(src.path)
        state = get_model_state_dict(model)
        read_model_state(src.path, state, manifest["files"], group)
        set_model_state_dict(model, state)
        read = sum(v["size"] for v in manifest["files"].values())
    log.info("model weights from %s: %.2f GB read by this rank in %.1f s", src, read / 1e9,
             time.perf_counter() - start)


def load_model(src: InitSource, device: torch.device | str = "cpu",
               args: Any = None) -> torch.nn.Module:
    """A whole model in one process with ``src``'s weights, in fp32, in eval mode (``args``:
    its shape, if known already)."""
    args = args or source_origin(src).args
    # Checked against the files before the model is allocated from config.json's sizes.
    reader = HFWeights(src.path, args) if src.kind == "hf" else None
    model = family_of_args(args).build(args)
    model.to_empty(device=device)
    model.init_buffers()
    if reader is not None:
        load_weights(model, reader.read)
        reader.close()
    else:
        manifest = verify_checkpoint(src.path)
        state = get_model_state_dict(model)
        read_model_state(src.path, state, manifest["files"])
        set_model_state_dict(model, state)
    return model.eval()
