"""Host buffers a checkpoint is staged into, shared with the rank's checkpoint writer process.

One anonymous shared-memory file (``memfd``: not under /dev/shm, so no tmpfs size cap applies
and nothing is left behind when a process dies) holds every tensor of this rank's state at a
fixed, 64-byte aligned offset. It is allocated, touched and, on CUDA, page-locked once
(``cudaHostRegister``) before the first save, so every save — the first included — costs only
the device-to-host copy. The writer process maps the same file (its descriptor is passed over
the pipe) and sees the copied bytes without another copy.

What a save sends the writer besides the bytes is a *skeleton*: the state dict with each tensor
replaced by ``Slot(i)``; non-tensor values (learning rates, betas) travel as they are. A DTensor's
place in the global tensor (DCP's chunk: offsets, sizes, global size) is taken from the DTensor
itself here and handed to the writer, whose planner (``StagedSavePlanner``) writes the plain
local buffer as that chunk: the files are exactly those a save of the DTensors would write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
from dataclasses import dataclass
from typing import Any

import psutil
import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

_ALIGN = 64
# Host memory to leave free beside the buffers (the data loader, the writer's serialisation).
_HEADROOM = 2 << 30


class StagingUnavailable(Exception):
    """This state cannot be staged for the writer process (the caller writes in a thread)."""


@dataclass(frozen=True)
class Slot:
    """Stands for the ``index``-th tensor of a staged state in a skeleton."""

    index: int


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives in the shared buffer, and which chunk of a DTensor it is."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    shard: TensorWriteData | None  # None: a plain tensor, written whole

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor."""
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """The tensors of a state dict in walk order (the order of ``Slot`` indices)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in tensors_of(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in tensors_of(v)]
    return []


def _skeleton(obj: Any, counter: list[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        counter[0] += 1
        return Slot(counter[0] - 1)
    if isinstance(obj, dict):
        return {k: _skeleton(v, counter) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_skeleton(v, counter) for v in obj)
    return obj


def _shard_of(t: torch.Tensor) -> TensorWriteData | None:
    """DCP's chunk for a DTensor (its own ``__create_write_items__``); None for a tensor."""
    if not hasattr(t, "to_local"):
        return None
    items = t.__create_write_items__("_", t)
    if len(items) != 1 or items[0].tensor_data is None:
        raise StagingUnavailable(f"a DTensor with {len(items)} local chunks")
    return items[0].tensor_data


def _specs(state: dict[str, Any]) -> tuple[list[TensorSpec], int]:
    specs, offset = [], 0
    for t in tensors_of(state):
        local = _local(t)
        spec = TensorSpec(offset, local.dtype, tuple(local.shape), _shard_of(t))
        specs.append(spec)
        offset += -(-spec.nbytes // _ALIGN) * _ALIGN
    return specs, max(offset, _ALIGN)


def views(mm: mmap.mmap, specs: list[TensorSpec]) -> list[torch.Tensor]:
    """One tensor per spec over the shared bytes ``mm``, each with its own storage.

    Its own storage, not a slice of one big tensor: DCP's writer clones every tensor whose
    storage is larger than the tensor (``_SerialCpuLoader``) before serialising it, which was
    the largest single cost of a save (2.2 of 6.4 s for 1 GB here).
    """
    return [torch.frombuffer(mm, dtype=s.dtype, count=s.nbytes // s.dtype.itemsize,
                             offset=s.offset).view(s.shape) if s.nbytes
            else torch.empty(s.shape, dtype=s.dtype) for s in specs]


class SharedStaging:
    """This rank's staging buffers: allocated once by ``allocate``, filled by ``stage``."""

    def __init__(self, specs: list[TensorSpec], nbytes: int, device: torch.device):
        self.specs = specs
        self.nbytes = nbytes
        self.device = device
        need = nbytes + _HEADROOM
        available = psutil.virtual_memory().available
        if available < need:
            raise StagingUnavailable(f"{nbytes / 1e9:.1f} GB of staging buffers do not fit the "
                                     f"{available / 1e9:.1f} GB of free host memory")
        self.fd = -1
        self._pinned = False
        try:
            self.fd = os.memfd_create("hpctrain-checkpoint", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, nbytes)
            self._mm = mmap.mmap(self.fd, nbytes)
            self.flat = torch.frombuffer(self._mm, dtype=torch.uint8)
            if device.type == "cuda":
                # Page-locked once (which also faults every page in): device-to-host copies run
                # at full PCIe speed, with no per-save pinning (the 8 s first save of the thread
                # writer).
                code = int(torch.cuda.cudart().cudaHostRegister(self.flat.data_ptr(), nbytes, 0))
                if code != 0:
                    raise StagingUnavailable(f"cudaHostRegister failed with CUDA error {code}")
                self._pinned = True
            else:
                self.flat.zero_()  # touch every page now: the first save pays no page faults
            self.buffers = views(self._mm, specs)
        except (OSError, RuntimeError, AttributeError) as e:
            self.close()
            raise StagingUnavailable(f"{nbytes / 1e9:.1f} GB of shared staging buffers: "
                                     f"{type(e).__name__}: {e}") from e
        except BaseException:
            self.close()
            raise

    @classmethod
    def allocate(cls, state: dict[str, Any], device: torch.device) -> SharedStaging:
        """Buffers laid out for ``state`` (model and optimizer state dicts of this rank)."""
        specs, nbytes = _specs(state)
        return cls(specs, nbytes, device)

    def matches(self, state: dict[str, Any]) -> bool:
        """Whether ``state`` has the tensors (dtype, local shape) these buffers were made for."""
        tensors = tensors_of(state)
        return len(tensors) == len(self.specs) and all(
            _local(t).dtype == s.dtype and tuple(_local(t).shape) == s.shape
            for t, s in zip(tensors, self.specs, strict=True))

    def stage(self, state: dict[str, Any]) -> Any:
        """Copy every tensor of ``state`` into the buffers; return the state's skeleton.

        Returns once the bytes are in host memory: the caller may change the tensors then.
        """
        for buf, t in zip(self.buffers, tensors_of(state), strict=True):
            buf.copy_(_local(t).detach(), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return _skeleton(state, [0])

    def close(self) -> None:
        """Unpin and unmap the buffers (the writer's mapping keeps its own reference)."""
        self.buffers = []
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr())
            self._pinned = False
        self.flat = None
        mm = getattr(self, "_mm", None)
        if mm is not None:
            _unmap(mm)
            self._mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class Attached:
    """The writer's side: the same buffers, mapped from the descriptor it was sent."""

    def __init__(self, fd: int, nbytes: int, specs: list[TensorSpec]):
        self._mm = mmap.mmap(fd, nbytes)
        os.close(fd)  # the mapping keeps the memory
        self.flat = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.buffers = views(self._mm, specs)
        self.shards = {id(b): s.shard for b, s in zip(self.buffers, specs, strict=True)
                       if s.shard is not None}

    def rebuild(self, skeleton: Any) -> Any:
        """The state dict a skeleton stands for, its tensors the shared buffers."""
        if isinstance(skeleton, Slot):
            return self.buffers[skeleton.index]
        if isinstance(skeleton, dict):
            return {k: self.rebuild(v) for k, v in skeleton.items()}
        if isinstance(skeleton, list | tuple):
            return type(skeleton)(self.rebuild(v) for v in skeleton)
        return skeleton

    def planner(self) -> StagedSavePlanner:
        """A save planner that writes each DTensor's buffer as its chunk of the global tensor."""
        return StagedSavePlanner(self.shards)

    def close(self) -> None:
        """Unmap."""
        self.buffers, self.shards, self.flat = [], {}, None
        _unmap(self._mm)


class StagedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, told which plain buffers are chunks of DTensors."""

    def __init__(self, shards: dict[int, TensorWriteData]):
        super().__init__()
        self._shards = shards

    def create_local_plan(self) -> SavePlan:
        """The default plan, with each DTensor buffer's item made a shard of the global tensor."""
        plan = super().create_local_plan()
        items = []
        for item in plan.items:
            shard = self._shards.get(id(self.state_dict.get(item.index.fqn)))
            if shard is not None:
                item = WriteItem(index=MetadataIndex(item.index.fqn, shard.chunk.offsets),
                                 type=WriteItemType.SHARD, tensor_data=shard)
            items.append(item)
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        """The buffer of a DTensor chunk by name (a plain tensor has no chunk offsets)."""
        obj = self.state_dict.get(index.fqn)
        if id(obj) in self._shards:
            return obj
        return super().lookup_object(index)


def _unmap(mm: mmap.mmap) -> None:
    # A tensor over it still referenced keeps the mapping; it goes with the process.
    with contextlib.suppress(BufferError):
        mm.close()
