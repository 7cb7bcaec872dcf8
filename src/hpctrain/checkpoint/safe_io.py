"""Reading checkpoint files without running code from them.

PyTorch's distributed checkpoint pickles the ``.metadata`` index, and ``torch.save``s every
tensor and non-tensor value (optimizer hyper-parameters) into the ``.distcp`` shards. Its stock
reader unpickles the index and the values with full trust (``pickle.load``,
``torch.load(weights_only=False)``). A checkpoint folder on a shared file system is not trusted
code, and its manifest has no key (anyone who can write a file can reseal the checksums), so:

- the index goes through an unpickler that resolves exactly the ``(module, name)`` pairs DCP's
  metadata refers to (its own classes, ``torch.Size``, dtypes, layouts, a ``PosixPath``), each
  to a fixed object: nothing is imported, no attribute path is followed (protocol 4 resolves
  ``os.system`` through any module that imports ``os``), so a dotted name is always refused;
- the index is then checked: it may point only at files the manifest lists, with no stream
  transforms (hpctrain's writer never uses them);
- every item of a shard, and the RNG files, load with ``torch.load(weights_only=True)``;
- a refusal names the file and the global it refused, as a :class:`DamagedCheckpoint`.
"""

from __future__ import annotations

import _compat_pickle
import ctypes
import dataclasses
import functools
import io
import logging
import os
import pickle
import re
import threading
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path, PosixPath
from typing import Any, BinaryIO

import torch
from torch import _weights_only_unpickler
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _create_file_view, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from hpctrain.checkpoint.manifest import (
    DamagedCheckpoint,
    is_int,
    is_plain_name,
    open_file,
    result_polled,
)
from hpctrain.shown import shown

log = logging.getLogger("hpctrain.checkpoint")

# What a tensor's or a value's bytes may hold is torch's weights-only allow-list; these
# patterns pull the refused global out of its (long, advice-laden) message.
_WEIGHTS_ONLY_REFUSALS = (
    re.compile(r"GLOBAL (\S+) was not an allowed global"),
    re.compile(r"unsupported GLOBAL (\S+) whose module"),
    re.compile(r"reduce for unrecognized function (.+?)(?: which belongs to|$)", re.M),
)


def _layouts() -> dict[str, torch.layout]:
    return {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


_LAYOUTS = _layouts()


def _layout(name: object) -> torch.layout:
    """Stands in for ``torch.serialization._get_layout``: a layout by name, nothing else."""
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"{name!r} is not a torch layout")
    return _LAYOUTS[name]


def _allowed_globals() -> dict[tuple[str, str], Any]:
    """Every global DCP's metadata pickle refers to, resolved once (checked against what
    torch 2.11 and 2.13 write, CPU and CUDA tensors, plain and FSDP state dicts).

    The classes are keyed by where they live, which is what the pickler writes. A dtype pickles
    as ``("torch", dtype.__reduce__())``; a layout through ``copyreg`` as
    ``torch.serialization._get_layout(name)``; ``StorageMeta.checkpoint_id`` holds the writer's
    ``PosixPath`` (``pathlib._local`` since Python 3.13).
    """
    classes = (Metadata, StorageMeta, MetadataIndex, TensorStorageMetadata,
               BytesStorageMetadata, ChunkStorageMetadata, TensorProperties,
               _MEM_FORMAT_ENCODING, _StorageInfo)
    allowed: dict[tuple[str, str], Any] = {(c.__module__, c.__qualname__): c for c in classes}
    allowed[("torch", "Size")] = torch.Size
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            allowed[("torch", value.__reduce__())] = value
    allowed[("torch.serialization", "_get_layout")] = _layout
    allowed[("pathlib", "PosixPath")] = PosixPath
    allowed[("pathlib._local", "PosixPath")] = PosixPath
    return allowed


ALLOWED_GLOBALS = _allowed_globals()


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle referred to a global that is not on the allow-list."""

    def __init__(self, module: str, name: str):
        why = " (a dotted name)" if "." in name else ""
        # The names are the pickle's own text: shown escaped and cut (a name can be any string).
        super().__init__(f"global {shown(module)}.{shown(name)} is not allowed{why}")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Never the base class's lookup: it imports ``module`` and follows dots in ``name``.
        if "." in name or (module, name) not in ALLOWED_GLOBALS:
            raise RefusedGlobal(module, name)
        return ALLOWED_GLOBALS[(module, name)]


def load_index(path: Path, files: Collection[str] | None = None) -> Metadata:
    """Unpickle and check a DCP ``.metadata`` index; ``files``: what the manifest lists."""
    try:
        with open_file(path) as f:  # a link in the checkpoint is refused
            metadata = _MetadataUnpickler(f).load()
    except RefusedGlobal as e:
        raise DamagedCheckpoint(f"{path}: {e} (a checkpoint index may hold only DCP's "
                                "metadata classes)") from None
    except Exception as e:  # noqa: BLE001 - any way a hostile pickle fails is damage
        raise DamagedCheckpoint(f"{path}: unreadable checkpoint index: "
                                f"{type(e).__name__}: {e}") from None
    _check_index(path, metadata, files)
    return metadata


def _check_index(path: Path, metadata: object, files: Collection[str] | None) -> None:
    if not isinstance(metadata, Metadata):
        raise DamagedCheckpoint(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    entries = metadata.state_dict_metadata
    if not (isinstance(entries, dict) and all(
            isinstance(k, str) and isinstance(v, TensorStorageMetadata | BytesStorageMetadata)
            for k, v in entries.items())):
        raise DamagedCheckpoint(f"{path}: malformed state_dict_metadata")
    if not isinstance(metadata.storage_data, dict):
        raise DamagedCheckpoint(f"{path}: malformed storage_data")
    for index, info in metadata.storage_data.items():
        if not (isinstance(index, MetadataIndex) and isinstance(info, _StorageInfo)
                and is_int(info.offset) and is_int(info.length)):
            raise DamagedCheckpoint(f"{path}: malformed storage entry {index!r}: {info!r}")
        rel = info.relative_path
        if not is_plain_name(rel) or (files is not None and rel not in files):
            raise DamagedCheckpoint(f"{path}: the index refers to {rel!r}, which is not a file "
                                    "this checkpoint's manifest lists")
        if info.transform_descriptors:
            raise DamagedCheckpoint(f"{path}: stream transforms {info.transform_descriptors!r} "
                                    "(hpctrain never writes them)")
    if not isinstance(metadata.storage_meta, StorageMeta | None):
        raise DamagedCheckpoint(f"{path}: malformed storage_meta")


def refusal(e: BaseException) -> str:
    """What ``torch.load(weights_only=True)`` refused, in one line without its unsafe advice."""
    text = str(e)
    for pattern in _WEIGHTS_ONLY_REFUSALS:
        match = pattern.search(text)
        if match:
            return f"global {shown(_python3_name(match[1].strip()))} is not allowed"
    detail = text.partition("WeightsUnpickler error:")[2] or text
    first = next((line.strip() for line in detail.splitlines() if line.strip()), "")
    return f"cannot be loaded: {type(e).__name__}: {shown(first)}"


def _python3_name(name: str) -> str:
    """The global a trusting unpickler would have called: torch drops ``builtins.`` from its
    message, and ``torch.save`` writes Python 2 names (``commands.Popen``) that load as
    Python 3 ones (``subprocess.Popen``)."""
    module, _, attr = name.rpartition(".")
    if not module:
        return f"builtins.{attr}"
    module, attr = _compat_pickle.NAME_MAPPING.get(
        (module, attr), (_compat_pickle.IMPORT_MAPPING.get(module, module), attr))
    return f"{module}.{attr}"


def load_weights_only(path: Path) -> Any:
    """``torch.load(weights_only=True)`` of one checkpoint file; DamagedCheckpoint otherwise."""
    try:
        with open_file(path) as f:  # a link in the checkpoint is refused
            return torch.load(f, map_location="cpu", weights_only=True)
    except (MemoryError, torch.OutOfMemoryError):
        raise
    except Exception as e:  # noqa: BLE001 - refused, truncated or not a torch file: damage
        raise DamagedCheckpoint(f"{path}: {refusal(e)} (a checkpoint file may hold only "
                                "tensors and plain values)") from None


class SafeFileSystemReader(FileSystemReader):
    """A FileSystemReader that runs no code from the checkpoint and names the file it refuses.

    ``files``: the names the manifest lists; the index may refer to no other file.
    ``ahead``: where the checksums are being read meanwhile, their ``Verification.wait_read``,
    which the load follows through the page cache.
    """

    def __init__(self, path: str | Path, files: Collection[str] | None = None, threads: int = 1,
                 ahead: Callable[[str, int, threading.Event], None] | None = None):
        super().__init__(path)
        self._files = files
        self._threads = max(1, threads)
        self._ahead = ahead
        self._metadata: Metadata | None = None

    # No ``**kwargs``: DCP then never falls back to per-rank ``__N.metadata`` files, which
    # hpctrain does not write and the manifest would not cover.
    def read_metadata(self) -> Metadata:
        """The checked index, read once (DCP asks for it again on every rank)."""
        if self._metadata is None:
            metadata = load_index(Path(self._get_metadata_path()), self._files)
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            self._metadata = metadata
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read the plan's files in threads: whole tensors straight into their destinations,
        the rest through DCP's path; a refusal names the file (and entry) it came from."""
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path,
                               []).append(item)
        # Resolved here, in the caller's thread: the planner is not the threads' to share.
        targets = {id(item): planner.resolve_tensor(item).detach() for item in plan.items
                   if item.type == LoadItemType.TENSOR}
        on_gpu = [target for target in targets.values() if target.is_cuda]
        staging: _Staging | None = None
        direct: list[_Span] = []
        try:
            # Buffers no larger than the largest GPU tensor: a small model pins little.
            if on_gpu:
                staging = _Staging(self._threads, on_gpu[0].device,
                                   min(_PIECE, max(t.nbytes for t in on_gpu)))
            direct = self._read_direct(by_file, targets, staging)
        except _FileFailed as e:
            raise self._damage(e.name, plan, by_file[e.name], planner, e.error) from None
        finally:
            if staging is not None:
                staging.close()
        for span in direct:
            planner.commit_tensor(span.item, span.target)
        read_directly = {id(span.item) for span in direct}
        for name, items in by_file.items():
            rest = [item for item in items if id(item) not in read_directly]
            if not rest:
                continue
            try:
                self._read(plan, rest, planner)
            except (MemoryError, torch.OutOfMemoryError, DamagedCheckpoint):
                raise
            except Exception as e:  # noqa: BLE001 - a refused pickle, a short read, a bad shape
                raise self._damage(name, plan, rest, planner, e) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_direct(self, by_file: dict[str, list[ReadItem]], targets: dict[int, torch.Tensor],
                     staging: _Staging | None) -> list[_Span]:
        """Read every whole tensor that can go straight into its destination (the others are
        left to DCP's path); the spans read.

        ``threads`` threads at once (system calls release the GIL), each through one file's
        records in the file's order (a stretch of one where files are fewer than threads): a
        record's tensor is found (its header and end read, two small reads) and read, on the
        CPU into its destination, for a GPU through ``staging``'s pinned buffers, copied
        asynchronously on the caller's stream. Where the checksums are being read meanwhile
        (``ahead``), a record is loaded once its file's check has read past it: the check reads
        the disk, the load follows it through the page cache, and the two overlap. Found first
        and read after, one file after another, the small reads of the finding waited for the
        disk behind the checks' streams, and the load began once the disk was read: on an H200
        host 14.2 s for 11 GB against 7.0 s to read the files and 5.9 s to load them warm.
        """
        parts = -(-self._threads // max(1, len(by_file)))  # every thread has a run
        # (file, record, whether to follow the file's check): only a file's first stretch
        # follows it, the others read the disk beside it (the check then finds their pages).
        runs: list[list[tuple[str, ReadItem, bool]]] = []
        for name, items in by_file.items():
            records = sorted((item for item in items if id(item) in targets),
                             key=lambda item: self.storage_data[item.storage_index].offset)
            stretches = _stretches(
                records, parts, lambda item: self.storage_data[item.storage_index].length)
            runs.extend([(name, item, i == 0) for item in run]
                        for i, run in enumerate(stretches))
        found: list[_Span] = []
        opened: dict[int, tuple[str, BinaryIO]] = {}  # each thread's file (a run is one file's)
        failed = threading.Event()

        def load(worker: int, task: tuple[str, ReadItem, bool]) -> None:
            name, item, follow = task
            info = self.storage_data[item.storage_index]
            try:
                if follow and self._ahead is not None:
                    self._ahead(name, info.offset + info.length, failed)
                if worker not in opened or opened[worker][0] != name:
                    if worker in opened:
                        opened.pop(worker)[1].close()
                    # A link in the checkpoint is refused.
                    opened[worker] = (name, open_file(Path(self.path) / name))
                f = opened[worker][1]
                span = self._direct_span(f, item, targets[id(item)])
                if span is not None:
                    _read_span(worker, f, span, staging, failed)
                    found.append(span)
            except (MemoryError, torch.OutOfMemoryError, DamagedCheckpoint):
                raise
            except Exception as e:  # noqa: BLE001 - the caller names the file's damage
                raise _FileFailed(name, e) from None

        def done(worker: int) -> None:
            try:
                if staging is not None:
                    staging.wait(worker)
            finally:
                if worker in opened:
                    opened.pop(worker)[1].close()

        _each(runs, self._threads, load, done=done, failed=failed,
              device=None if staging is None else staging.stream.device)
        return found

    def _direct_span(self, f: BinaryIO, item: ReadItem, target: torch.Tensor) -> _Span | None:
        """Where a whole saved tensor's bytes lie in ``f``, to be read straight into its
        destination ``target`` (a contiguous CPU or CUDA tensor); None for anything else,
        which DCP's own path reads.

        DCP's path ``torch.load``s each tensor into new memory and copies it into the
        destination: 2.7 of 3.5 s for 1 GB here. The saved tensor's layout is taken from its
        own pickle, unpickled weights-only onto the meta device (no memory, no code), and the
        bytes are read only when it is exactly the destination's: contiguous, same dtype and
        shape, the whole chunk. Integrity is the manifest's xxh3, which the caller checks
        (``CheckpointManager.load``) before the state is used.
        """
        if item.type != LoadItemType.TENSOR or any(item.storage_offsets):
            return None
        if (target.device.type not in ("cpu", "cuda") or not target.is_contiguous()
                or tuple(item.lengths) != tuple(target.shape)):
            return None
        info = self.storage_data[item.storage_index]
        try:
            archive = torch._C.PyTorchFileReader(_create_file_view(f, info.offset, info.length))
            saved = _saved_layout(archive.get_record("data.pkl"))
            # The record's size is the pickle's storage size (checked below): torch 2.11's
            # reader has no ``get_record_size``, and asking for it sent every tensor through
            # DCP's path, one after another in the caller's thread, on the H200 hosts.
            at = archive.get_record_offset("data/0")
        except Exception as e:  # noqa: BLE001 - not what torch.save writes: DCP's path judges it
            log.debug("%s: read through DCP's path (%s: %s)", item.storage_index.fqn,
                      type(e).__name__, e)
            return None
        if not (isinstance(saved, torch.Tensor) and saved.dtype == target.dtype
                and saved.shape == target.shape and saved.is_contiguous()
                and saved.storage_offset() == 0
                and saved.untyped_storage().nbytes() == target.nbytes
                and at + target.nbytes <= info.length):
            return None
        return _Span(target, Path(f.name), info.offset + at, item.storage_index.fqn, item)

    def _read(self, plan: LoadPlan, items: list[ReadItem], planner: LoadPlanner) -> None:
        super().read_data(dataclasses.replace(plan, items=items), planner).wait()

    def _damage(self, name: str, plan: LoadPlan, items: list[ReadItem], planner: LoadPlanner,
                error: Exception) -> DamagedCheckpoint:
        """The file's failure, naming the first entry that fails on its own (the state is
        being discarded anyway, so reading entries again does no harm)."""
        entry = ""
        for item in items:
            try:
                self._read(plan, [item], planner)
            except Exception as e:  # noqa: BLE001 - the culprit found
                entry, error = f" (entry {item.storage_index.fqn})", e
                break
        return DamagedCheckpoint(f"{Path(self.path) / name}{entry}: {refusal(error)}")


# Bytes one read (and, for a GPU, one host-to-device copy) moves: big enough that a system call
# per piece costs nothing, small enough that the threads share a big tensor between them.
_PIECE = 32 << 20


@dataclasses.dataclass
class _Span:
    """A saved tensor's bytes in a shard file, and the tensor they fill."""

    target: torch.Tensor  # contiguous, on the CPU or a GPU
    path: Path  # the shard file
    offset: int  # of its first byte in the file
    fqn: str  # its name, for an error
    item: ReadItem | None = None  # what DCP planned it as


class _FileFailed(Exception):
    """Reading one of the checkpoint's files failed (the caller names the damage)."""

    def __init__(self, name: str, error: Exception):
        super().__init__(name)
        self.name, self.error = name, error


def _read_span(worker: int, f: BinaryIO, span: _Span, staging: _Staging | None,
               failed: threading.Event) -> None:
    """Fill ``span``'s tensor from ``f`` in pieces, in order (on a GPU through ``worker``'s
    buffers of ``staging``); stops early once ``failed`` is set (the load is failing)."""
    flat = span.target.reshape(-1).view(torch.uint8)
    for start in range(0, span.target.nbytes, _PIECE):
        if failed.is_set():
            return
        piece = flat[start:start + _PIECE]
        if piece.device.type == "cpu":
            _read_into(f, piece, span.offset + start, span.fqn)
        else:
            staging.fill(worker, f, piece, span.offset + start, span.fqn)


def _stretches(tasks: list[Any], parts: int, size: Callable[[Any], int]) -> list[list[Any]]:
    """``tasks`` (one file's, in order) cut into up to ``parts`` runs of about equal bytes."""
    total = sum(size(task) for task in tasks)
    runs: list[list[Any]] = [[]]
    done = 0
    for task in tasks:
        if runs[-1] and done >= total * len(runs) / parts:
            runs.append([])
        runs[-1].append(task)
        done += size(task)
    return [run for run in runs if run]


def _each(runs: list[list[Any]], threads: int, do: Callable[[int, Any], None], *,
          done: Callable[[int], None] | None = None, device: torch.device | None = None,
          failed: threading.Event | None = None) -> None:
    """``do(worker, task)`` for every task, each run of tasks in order by one of up to
    ``threads`` threads (each then runs ``done(worker)``, on a GPU ``device``): the first
    failure (or Ctrl-C) sets ``failed`` and stops the others at their next task, and nothing
    returns while a thread still runs."""
    runs = [run for run in runs if run]
    if not runs:
        return
    queue = iter(runs)
    lock = threading.Lock()
    if failed is None:
        failed = threading.Event()
    # Set once every worker is submitted: an interrupt inside ``submit`` leaves a thread the
    # pool does not track yet, which must then find ``failed`` set before it reads anything.
    go = threading.Event()

    def work(worker: int) -> None:
        try:
            go.wait()
            while not failed.is_set():
                with lock:
                    run = next(queue, None)
                if run is None:
                    break
                for task in run:
                    if failed.is_set():
                        break
                    do(worker, task)
        except BaseException:
            failed.set()
            raise
        finally:
            if done is not None:
                done(worker)

    n = min(threads, len(runs))
    if n == 1:
        go.set()
        work(0)
        return
    # A new thread starts on GPU 0: its first CUDA call would make a context there on every
    # rank; the caller's thread is on its own device already.
    pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="hpctrain-load",
                              initializer=None if device is None else torch.cuda.set_device,
                              initargs=() if device is None else (device,))
    futures = []
    try:
        futures.extend(pool.submit(work, worker) for worker in range(n))
        go.set()
        for future in futures:
            result_polled(future)  # polled: a Ctrl-C just before a blocking wait is still seen
    finally:
        # Interrupted (Ctrl-C) or failed: the others stop at their next task, and nothing
        # returns while a thread still reads into a tensor or a buffer the caller frees.
        failed.set()
        go.set()
        wait(futures)
        pool.shutdown()


class _Staging:
    """Two host buffers for each loading thread, pinned for the load (``cudaHostRegister``,
    undone by ``close``, so the memory goes back after it): one is read into while the other
    is copied to the GPU on the caller's stream."""

    def __init__(self, threads: int, device: torch.device, size: int):
        self.stream = torch.cuda.current_stream(device)
        page = 4096  # registered memory starts on a page
        size = -(-size // page) * page
        raw = torch.empty(threads * 2 * size + page, dtype=torch.uint8)
        self.flat = raw[(-raw.data_ptr()) % page:][:threads * 2 * size]
        # Unpinned (registration refused), the copies are synchronous: slower, still right.
        self.pinned = _cuda_call("cudaHostRegister", torch.cuda.cudart().cudaHostRegister(
            self.flat.data_ptr(), self.flat.nbytes, 0))
        self.buffers = [[self.flat[(2 * t + i) * size:(2 * t + i + 1) * size]
                         for i in range(2)] for t in range(threads)]
        self.copied: list[list[torch.cuda.Event | None]] = [[None, None] for _ in range(threads)]
        self.turn = [0] * threads

    def fill(self, worker: int, f: BinaryIO, dest: torch.Tensor, offset: int, fqn: str) -> None:
        """Read ``dest``'s bytes from ``offset`` of ``f`` into one of ``worker``'s buffers and
        start their copy into ``dest``."""
        i = self.turn[worker]
        self.turn[worker] = 1 - i
        copied = self.copied[worker]
        if copied[i] is not None:
            copied[i].synchronize()  # the buffer's previous copy is done with it
        host = self.buffers[worker][i][:dest.numel()]
        _read_into(f, host, offset, fqn)
        with torch.cuda.stream(self.stream):
            dest.copy_(host, non_blocking=True)
            copied[i] = torch.cuda.Event()
            copied[i].record(self.stream)

    def wait(self, worker: int) -> None:
        """Until every copy started from ``worker``'s buffers has finished."""
        for event in self.copied[worker]:
            if event is not None:
                event.synchronize()

    def close(self) -> None:
        """Unpin the buffers once every copy from them has finished."""
        # Each worker waited for its own copies, unless an error or Ctrl-C cut that short.
        self.stream.synchronize()
        if self.pinned:
            _cuda_call("cudaHostUnregister",
                       torch.cuda.cudart().cudaHostUnregister(self.flat.data_ptr()))
            self.pinned = False


def _cuda_call(name: str, status: object) -> bool:
    """Whether a raw CUDA runtime call succeeded; a failure is logged and its error cleared
    (left pending, the next kernel launch would report it as its own)."""
    code = int(status)
    if code == 0:
        return True
    cudart = _cudart()
    if cudart is not None:
        cudart.cudaGetLastError()
    log.warning("%s failed (CUDA error %d%s): restoring without pinned buffers", name, code,
                "" if cudart is not None else "; could not clear it: libcudart not found")
    return False


@functools.cache
def _cudart() -> ctypes.CDLL | None:
    """The CUDA runtime torch loaded (opened by its soname: the same library, not another)."""
    try:
        return ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}")
    except (OSError, AttributeError):
        return None


def _read_into(f: BinaryIO, dest: torch.Tensor, offset: int, fqn: str) -> None:
    """Read ``dest.numel()`` bytes at ``offset`` of ``f`` into ``dest`` (contiguous uint8 on
    the CPU); a file that ends first is damaged."""
    view = memoryview(dest.numpy())
    done = 0
    while done < len(view):
        n = os.preadv(f.fileno(), [view[done:]], offset + done)
        if n <= 0:
            raise DamagedCheckpoint(f"{f.name}: ends inside {fqn}")
        done += n


def _saved_layout(pickled: bytes) -> Any:
    """What a ``torch.save`` pickle holds, each tensor on the meta device (its dtype, shape,
    strides and storage size, no bytes); unpickled weights-only, as ``torch.load`` would."""

    def storage(saved_id: tuple) -> torch.TypedStorage:
        _kind, storage_type, _key, _location, numel = saved_id
        dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
        return torch.TypedStorage(wrap_storage=torch.UntypedStorage(
            numel * dtype.itemsize, device="meta"), dtype=dtype, _internal=True)

    unpickler = _weights_only_unpickler.Unpickler(io.BytesIO(pickled), encoding="utf-8")
    unpickler.persistent_load = storage
    return unpickler.load()


class SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor values with ``torch.load(weights_only=True)``.

    The optimizer's settings are saved per parameter (``param_groups.<fqn>.lr``, 12 a
    parameter for AdamW: ~1,800 values for a 1b model, 0.2-0.5 ms each through
    ``torch.load``), nearly all alike: a value whose bytes were seen before and that cannot be
    changed in place (numbers, strings, tuples of them) is taken from the first.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._seen: dict[bytes, Any] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Unpickle one value (tensors and plain types only) into the state dict."""
        raw = value.getvalue()
        if raw in self._seen:
            obj = self._seen[raw]
        else:
            obj = torch.load(value, weights_only=True)
            if _immutable(obj):
                self._seen[raw] = obj
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _immutable(obj: object) -> bool:
    """A value nobody can change in place: None, a number, a string, a tuple of these."""
    if isinstance(obj, tuple):
        return all(_immutable(x) for x in obj)
    return obj is None or type(obj) in (bool, int, float, complex, str, bytes)
