"""DCP reading without arbitrary unpickling.

PyTorch's distributed checkpoint pickles two things: the ``.metadata`` index and non-tensor
values (optimizer hyper-parameters). Its stock reader unpickles both with full trust
(``pickle.load`` and ``torch.load(weights_only=False)``). A checkpoint directory on a shared
file system is not trusted code, so here the index goes through an allow-list unpickler that
builds only DCP's own metadata classes, and values load with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from hpctrain.checkpoint.manifest import CheckpointError

# Exactly what DCP's metadata pickle refers to (checked on torch 2.11 and 2.13).
_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata",
                    "torch.distributed.checkpoint.filesystem")
_ALLOWED_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                    ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


class SafeFileSystemReader(FileSystemReader):
    """A FileSystemReader whose metadata index cannot run code when it is read."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except (pickle.UnpicklingError, EOFError, AttributeError) as e:
                raise CheckpointError(f"{path}: unreadable checkpoint index: {e}") from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
