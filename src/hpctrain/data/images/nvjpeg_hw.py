"""JPEGs decoded by the GPU's hardware JPEG engines (NVJPG: A100, H100, H200, ...) through
nvJPEG's hardware backend, bound with ctypes.

    why_not = hardware_unavailable(device)            # None where the engines work
    images = hardware_decode([jpeg, ...], device)     # uint8 (3, H, W) views, None: not taken

Why our own binding: torchvision's ``decode_jpeg(list, device="cuda")`` decodes on a stream of
its own, waits for it on the host before and after each batch, and allocates each image apart;
which of its JPEGs reach the engines is up to its build (measured: `benchmarks/images.py
--decoders hardware cuda`, NVML's JPEG engine utilisation per row). Here each call decodes the
batch on the caller's current stream, into ONE uint8 tensor allocated on that stream (a
(3, H, W) view per image), and returns without waiting for the device: the stream discipline
is the caller's, as for any kernel (`hpctrain.data.images.ahead`).

ctypes, not a C extension: nothing to build on the GPU machines. The library is the real
libnvjpeg: the copy torchvision already loaded (/proc/self/maps), else
``$CUDA_HOME/lib64``, /usr/local/cuda/lib64, torchvision.libs, the nvidia wheels; never a
``stubs/`` copy (it links, and every call fails). The enum values and the ``nvjpegImage_t``
layout come from nvjpeg.h (CUDA 11+): 4 channel pointers, then 4 ``size_t`` pitches.

Which JPEGs go to the engines: those whose markers `jpeg_header.engine_refusal` accepts
(baseline, 1 or 3 components, the subsamplings the engines take, not truncated), sized by their
frame header. A batch costs the host one nvJPEG call: a call per image (nvJPEG's own header
check, ``nvjpegJpegStreamParseHeader`` + ``nvjpegDecodeBatchedSupported``) releases and takes
back the GIL each time, which the training thread paid for (ResNet-50 on an H200: 3,323 img/s
with them against 4,016 through torchvision). nvJPEG's check runs only after a batch fails, to
drop what it refuses before the rest goes again; a refused or failed image comes back as None:
the caller decodes it another way.

nvJPEG's handles and states are not for two threads at once: each decoding thread checks out a
decoder (handle, state, stream parser) of a per-device pool for the call, so a thread that
comes and goes (validation's read-ahead) reuses one instead of adding one. Before a decoder's
state is used again, the host waits for its previous batch's event (nvJPEG reuses its
internal staging buffers from call to call; the decoding thread has usually moved on by then,
so this seldom waits). They live for the process, as torchvision's decoder does;
`close_decoders` frees them.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hpctrain.data.images.jpeg_header import engine_refusal, read_jpeg_header
from hpctrain.errors import ConfigError

log = logging.getLogger("hpctrain.data")

# nvjpeg.h: nvjpegBackend_t, nvjpegOutputFormat_t, libraryPropertyType, NVJPEG_MAX_COMPONENT.
NVJPEG_BACKEND_HARDWARE = 3
NVJPEG_OUTPUT_RGB = 3  # planar R, G, B: one plane per channel pointer
MAX_COMPONENT = 4
_MAJOR_VERSION, _MINOR_VERSION, _PATCH_LEVEL = 0, 1, 2
STATUS = {0: "SUCCESS", 1: "NOT_INITIALIZED", 2: "INVALID_PARAMETER", 3: "BAD_JPEG",
          4: "JPEG_NOT_SUPPORTED", 5: "ALLOCATOR_FAILURE", 6: "EXECUTION_FAILED",
          7: "ARCH_MISMATCH", 8: "INTERNAL_ERROR", 9: "IMPLEMENTATION_NOT_SUPPORTED",
          10: "INCOMPLETE_BITSTREAM"}

DECODERS = ("auto", "hardware", "cuda")


class NvjpegImage(ctypes.Structure):
    """nvjpeg.h's ``nvjpegImage_t``: where each output plane goes, and its row pitch."""

    _fields_ = [("channel", ctypes.c_void_p * MAX_COMPONENT),
                ("pitch", ctypes.c_size_t * MAX_COMPONENT)]


# The same layout as a numpy record, to fill a batch's in one go (size_t and pointers are
# uintp wide on the platforms CUDA runs on; a test pins the offsets against the struct).
IMAGE_DTYPE = np.dtype([("channel", np.uintp, (MAX_COMPONENT,)),
                        ("pitch", np.uintp, (MAX_COMPONENT,))])


def plane_table(out: torch.Tensor, sizes: Sequence[tuple[int, int]],
                ) -> tuple[np.ndarray, list[torch.Tensor]]:
    """Planar RGB images of ``sizes`` (H, W) packed one after the other in the uint8 tensor
    ``out``: their ``nvjpegImage_t`` records (R, G, B plane addresses, rows of W bytes) and
    their (3, H, W) views. Built with numpy for the batch, not field by field: the decoding
    thread holds the GIL meanwhile."""
    hw = np.array(sizes, dtype=np.int64).reshape(-1, 2)
    plane = hw[:, 0] * hw[:, 1]
    planes = np.zeros(len(hw), dtype=IMAGE_DTYPE)
    starts = out.data_ptr() + np.concatenate(([0], np.cumsum(3 * plane)[:-1]))
    for c in range(3):
        planes["channel"][:, c] = starts + c * plane
        planes["pitch"][:, c] = hw[:, 1]
    parts = out[:int(3 * plane.sum())].split((3 * plane).tolist())
    return planes, [part.view(3, h, w) for part, (h, w) in zip(parts, sizes, strict=True)]


class NvjpegError(RuntimeError):
    """An nvJPEG call returned a non-zero status."""

    def __init__(self, function: str, status: int):
        self.function, self.status = function, status
        super().__init__(f"{function} returned {status} "
                         f"(NVJPEG_STATUS_{STATUS.get(status, 'UNKNOWN')})")


# --- the library ---------------------------------------------------------------------------

_LIB_NAME = re.compile(r"libnvjpeg[^/]*\.so[.0-9]*$")


class HardwareUnavailable(Exception):
    """The hardware JPEG decoder cannot be used here; the message says why."""


def _is_stub(path: Path) -> bool:
    return "stubs" in path.parts


def _mapped(maps: Path) -> list[Path]:
    """libnvjpeg copies already mapped into this process (torchvision's, once it decoded)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
        if path.startswith("/") and _LIB_NAME.search(path) and Path(path) not in found:
            found.append(Path(path))
    return found


def library_dirs() -> list[Path]:
    """Where to look for libnvjpeg after the mapped copies, in order."""
    dirs = [Path(os.environ[v]) / "lib64" for v in ("CUDA_HOME", "CUDA_PATH")
            if os.environ.get(v)]
    dirs.append(Path("/usr/local/cuda/lib64"))
    for package in ("torchvision", "nvidia"):
        try:  # find_spec does not import the package
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            if package == "torchvision":
                dirs.append(Path(loc).parent / "torchvision.libs")
            else:  # the nvidia-* wheels: nvidia/<name>/lib
                dirs.extend(sorted(Path(loc).glob("*/lib")))
    return dirs


def library_candidates(maps: Path = Path("/proc/self/maps"),
                       dirs: Sequence[Path] | None = None) -> list[Path]:
    """The real libnvjpeg files to try, best first: mapped ones, then those in ``dirs``
    (default `library_dirs`); never a stub."""
    found = _mapped(maps)
    for d in library_dirs() if dirs is None else dirs:
        if d.is_dir():
            found += sorted((p for p in d.iterdir() if _LIB_NAME.search(p.name)),
                            key=lambda p: (p.name == "libnvjpeg.so", len(p.name)))
    unique: list[Path] = []
    for p in found:
        if not _is_stub(p) and p not in unique:
            unique.append(p)
    return unique


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the signatures (nvjpeg.h) of the functions used: a wrong guess would corrupt
    the stack silently."""
    p, i, u, z = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
    ip, pp = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p)
    signatures = {
        "nvjpegGetProperty": [i, ip],
        "nvjpegCreateEx": [i, p, p, u, pp],
        "nvjpegDestroy": [p],
        "nvjpegJpegStateCreate": [p, pp],
        "nvjpegJpegStateDestroy": [p],
        "nvjpegJpegStreamCreate": [p, pp],
        "nvjpegJpegStreamDestroy": [p],
        "nvjpegJpegStreamParseHeader": [p, p, z, p],
        "nvjpegDecodeBatchedSupported": [p, p, ip],
        "nvjpegDecodeBatchedInitialize": [p, p, i, i, i],
        "nvjpegDecodeBatched": [p, p, pp, ctypes.POINTER(z), ctypes.POINTER(NvjpegImage), p],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)  # AttributeError: not an nvJPEG library
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(lib: ctypes.CDLL, name: str, *args) -> None:
    status = getattr(lib, name)(*args)
    if status != 0:
        raise NvjpegError(name, status)


@dataclass
class Library:
    """A loaded libnvjpeg and where it came from."""

    lib: ctypes.CDLL
    path: Path
    version: str


_library: list[Library | HardwareUnavailable] = []
_library_lock = threading.Lock()


def load_library(maps: Path = Path("/proc/self/maps"),
                 dirs: Sequence[Path] | None = None) -> Library:
    """The first candidate that loads and has nvJPEG's functions; HardwareUnavailable if
    none (the message lists what was tried)."""
    candidates = library_candidates(maps, dirs)
    if not candidates:
        where = ", ".join(str(d) for d in (library_dirs() if dirs is None else dirs))
        raise HardwareUnavailable(f"libnvjpeg not found (not loaded, nor in {where})")
    failures = []
    for path in candidates:
        try:
            lib = _bind(ctypes.CDLL(str(path)))
            parts = []
            for prop in (_MAJOR_VERSION, _MINOR_VERSION, _PATCH_LEVEL):
                value = ctypes.c_int()
                _check(lib, "nvjpegGetProperty", prop, ctypes.byref(value))
                parts.append(str(value.value))
            return Library(lib, path, ".".join(parts))
        except (OSError, AttributeError, NvjpegError) as e:
            failures.append(f"{path}: {e}")
    raise HardwareUnavailable("no libnvjpeg loads: " + "; ".join(failures))


def _the_library() -> Library:
    """This process's libnvjpeg, found once (HardwareUnavailable, remembered, if none)."""
    with _library_lock:
        if not _library:
            # torchvision's image extension links its own libnvjpeg: once imported, that copy
            # is mapped and found first, and the process holds one copy, not two.
            with contextlib.suppress(Exception):
                import torchvision.io  # noqa: F401
            try:
                _library.append(load_library())
            except HardwareUnavailable as e:
                _library.append(e)
        found = _library[0]
    if isinstance(found, HardwareUnavailable):
        raise found
    return found


# --- decoding ------------------------------------------------------------------------------


class _Decoder:
    """One nvJPEG handle (hardware backend), decoding state and header parser, on one device:
    used by one thread at a time (`_take` and `_give`)."""

    def __init__(self, library: Library, device: torch.device):
        self.lib, self.device = library.lib, device
        self.handle, self.state, self.stream = (ctypes.c_void_p() for _ in range(3))
        self.batch_size = 0  # what the state was initialised for (0: needs initialising)
        # The previous batch's end on its stream, and its inputs, kept alive until then.
        self.done: torch.cuda.Event | None = None
        self.inputs: list[torch.Tensor] = []
        with torch.cuda.device(device):  # nvJPEG binds handles to the current device
            _check(self.lib, "nvjpegCreateEx", NVJPEG_BACKEND_HARDWARE, None, None, 0,
                   ctypes.byref(self.handle))
            try:
                _check(self.lib, "nvjpegJpegStateCreate", self.handle, ctypes.byref(self.state))
                _check(self.lib, "nvjpegJpegStreamCreate", self.handle,
                       ctypes.byref(self.stream))
            except NvjpegError:
                self.close()
                raise

    def supported(self, data: torch.Tensor) -> bool:
        """Whether nvJPEG's own header check says the hardware backend takes this JPEG."""
        if self.lib.nvjpegJpegStreamParseHeader(self.handle, data.data_ptr(), data.numel(),
                                                self.stream) != 0:
            return False
        supported = ctypes.c_int(-1)
        return (self.lib.nvjpegDecodeBatchedSupported(self.handle, self.stream,
                                                      ctypes.byref(supported)) == 0
                and supported.value == 0)  # 0 means supported

    def decode(self, data: list[torch.Tensor], sizes: list[tuple[int, int]],
               ) -> list[torch.Tensor | None]:
        """The JPEGs decoded on the current stream into views of one new tensor (None where
        one is not decoded: the batch failed, and it fails again without the others)."""
        out = torch.empty(sum(3 * h * w for h, w in sizes), dtype=torch.uint8,
                          device=self.device)
        planes, views = plane_table(out, sizes)
        stream = torch.cuda.current_stream(self.device)
        self._wait_previous()
        try:
            self._batched(data, planes, stream)
            result: list[torch.Tensor | None] = list(views)
        except NvjpegError as first:
            result = self._retry(data, planes, views, stream, first)
        self.done = torch.cuda.Event()
        self.done.record(stream)
        self.inputs = data
        return result

    def _retry(self, data: list[torch.Tensor], planes: np.ndarray, views: list[torch.Tensor],
               stream: torch.cuda.Stream, first: NvjpegError) -> list[torch.Tensor | None]:
        """After a failed batch: nvJPEG's own check drops the JPEGs it refuses (the marker
        check let them through), the rest go again together, then one by one if that fails
        too (a corrupt one among them)."""
        result: list[torch.Tensor | None] = [None] * len(data)
        taken = [k for k, d in enumerate(data) if self.supported(d)]
        try:
            self._batched([data[k] for k in taken], planes[taken], stream)
            for k in taken:
                result[k] = views[k]
        except NvjpegError:
            for k in taken:
                try:
                    self._batched(data[k:k + 1], planes[k:k + 1], stream)
                    result[k] = views[k]
                except NvjpegError:
                    pass
            if len(taken) == len(data) and all(img is not None for img in result):
                # Not one image's fault: the batch itself (its size?) fails.
                _say(f"a hardware JPEG batch failed ({first}) though each image decodes "
                     "alone: batches that fail are decoded one image at a time",
                     logging.WARNING)
        return result

    def _batched(self, data: list[torch.Tensor], planes: np.ndarray,
                 stream: torch.cuda.Stream) -> None:
        n = len(data)
        if self.batch_size != n:
            self.batch_size = 0
            _check(self.lib, "nvjpegDecodeBatchedInitialize", self.handle, self.state, n, 1,
                   NVJPEG_OUTPUT_RGB)
            self.batch_size = n
        pointers = np.fromiter((d.data_ptr() for d in data), dtype=np.uintp, count=n)
        lengths = np.fromiter((d.numel() for d in data), dtype=np.uintp, count=n)
        planes = np.ascontiguousarray(planes)
        try:
            _check(self.lib, "nvjpegDecodeBatched", self.handle, self.state,
                   pointers.ctypes.data_as(ctypes.POINTER(ctypes.c_void_p)),
                   lengths.ctypes.data_as(ctypes.POINTER(ctypes.c_size_t)),
                   planes.ctypes.data_as(ctypes.POINTER(NvjpegImage)), stream.cuda_stream)
        except NvjpegError:
            self.batch_size = 0  # nvJPEG: initialise again after a failed batch
            raise

    def _wait_previous(self) -> None:
        if self.done is not None:
            self.done.synchronize()
            self.done, self.inputs = None, []

    def close(self) -> None:
        """Wait for the last batch, then free the parser, state and handle."""
        if self.done is not None:
            self.done.synchronize()
        for name, obj in (("nvjpegJpegStreamDestroy", self.stream),
                          ("nvjpegJpegStateDestroy", self.state),
                          ("nvjpegDestroy", self.handle)):
            if obj.value:
                _check(self.lib, name, obj)
                obj.value = None


_idle: dict[int, list[_Decoder]] = {}
_idle_lock = threading.Lock()


def _take(device: torch.device) -> _Decoder:
    """A decoder of ``device`` for this thread's call (an idle one, else a new one): give it
    back with `_give`."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _idle_lock:
        pool = _idle.get(index)
        decoder = pool.pop() if pool else None
    return decoder or _Decoder(_the_library(), torch.device("cuda", index))


def _give(decoder: _Decoder) -> None:
    """``decoder`` back in its device's pool."""
    with _idle_lock:
        _idle.setdefault(decoder.device.index, []).append(decoder)


def close_decoders() -> None:
    """Free the pooled decoders (those not in use); later calls make new ones."""
    with _idle_lock:
        decoders = [d for pool in _idle.values() for d in pool]
        _idle.clear()
    for d in decoders:
        d.close()


_probed: dict[int, str | None] = {}


def hardware_unavailable(device: str | torch.device) -> str | None:
    """Why the hardware JPEG decoder cannot be used on ``device`` (None: it can), found once
    per device by making a decoder (kept for the first decode)."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"the device is {device}, not a CUDA GPU"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _probed:
        try:
            _give(_take(torch.device("cuda", index)))  # kept for the first decode
            _probed[index] = None
        except HardwareUnavailable as e:
            _probed[index] = str(e)
        except NvjpegError as e:
            why = ("this GPU has no hardware JPEG decoder" if e.status == 7 else
                   "the hardware backend does not start")
            _probed[index] = f"{why}: {e}"
    return _probed[index]


def hardware_decode(data: Sequence[torch.Tensor], device: str | torch.device,
                    ) -> list[torch.Tensor | None]:
    """JPEGs (uint8 1-D CPU tensors) decoded by the hardware engines on ``device``'s current
    stream, as uint8 (3, H, W) views of one tensor; None for each one they do not take (see
    the module docstring) or that fails: decode those another way. Returns before the device
    has decoded them."""
    device = torch.device(device)
    out: list[torch.Tensor | None] = [None] * len(data)
    try:
        decoder = _take(device)
    except (HardwareUnavailable, NvjpegError) as e:  # a decoder for one more thread
        _say(f"no hardware JPEG decoder for this thread ({e}): its JPEGs go to nvJPEG on the "
             "SMs", logging.WARNING)
        return out
    try:
        _decode_into(decoder, data, out)
    finally:
        _give(decoder)
    return out


def _decode_into(decoder: _Decoder, data: Sequence[torch.Tensor],
                 out: list[torch.Tensor | None]) -> None:
    """`hardware_decode` with ``decoder``: the images it takes, into ``out``."""
    with torch.cuda.device(decoder.device):
        take, inputs, sizes = [], [], []
        for i, d in enumerate(data):
            d = d if d.is_contiguous() else d.contiguous()
            header = read_jpeg_header(d.numpy())
            # The markers alone decide here (no per-image nvJPEG call: each one is a GIL
            # release and re-take that the training thread pays for; nvJPEG's own check runs
            # after a batch fails). The frame's size is the output's for every subsampling
            # the engines take (the luma plane is full size).
            if engine_refusal(header) is None:
                take.append(i)
                inputs.append(d)
                sizes.append((header.height, header.width))
        if take:
            for i, img in zip(take, decoder.decode(inputs, sizes), strict=True):
                out[i] = img


def choose_decoder(setting: str, device: str | torch.device) -> str:
    """The JPEG decoder for ``setting`` on ``device``: "hardware" (the engines) or "cuda"
    (nvJPEG on the SMs, through torchvision), said once in the log with why; ConfigError when
    ``hardware`` is asked for and cannot be had."""
    if setting not in DECODERS:
        raise ConfigError(f"JPEG decoder {setting!r} is not known",
                          expected=" or ".join(DECODERS))
    if setting == "cuda":
        _say(f"decoding JPEGs on the SMs (nvJPEG through torchvision): the setting is {setting}")
        return "cuda"
    why = hardware_unavailable(device)
    if why is None:
        found = _the_library()
        _say(f"decoding JPEGs on the GPU's hardware JPEG engines (libnvjpeg {found.version} at "
             f"{found.path}); progressive, CMYK and other JPEGs they refuse go to nvJPEG on "
             "the SMs")
        return "hardware"
    if setting == "hardware":
        raise ConfigError(f"the hardware JPEG decoder was asked for, but {why}",
                          expected="a GPU with JPEG engines (A100, H100, H200, ...) and CUDA's "
                          "libnvjpeg (11.0 or newer)",
                          hint="set task_args.jpeg_decoder=auto (the engines where they work, "
                          "else the SMs) or =cuda; CUDA_HOME=/path/to/cuda points to the "
                          "library")
    _say(f"hardware JPEG decoder not available: {why}; decoding on the SMs")
    return "cuda"


_said: set[str] = set()


def _say(message: str, level: int = logging.INFO) -> None:
    """Log ``message`` once per process (each pipeline asks; the run log says it once)."""
    if message not in _said:
        _said.add(message)
        log.log(level, message)
