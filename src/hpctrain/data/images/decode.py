"""Encoded images to uint8 CHW tensors: nvJPEG in batches on CUDA, Pillow on the CPU.

    out = decode_batch(images, "cuda")          # a list of uint8 (3, H, W) tensors on cuda
    labels = labels[out.kept]                   # a corrupt image shrinks the batch

On CUDA the JPEGs of a batch go to ``torchvision.io.decode_jpeg(list, device="cuda")`` in one
call (batched nvJPEG); if that call fails, each image is tried alone, then with Pillow (CMYK
JPEGs, which nvJPEG may refuse), so one bad image costs a retry, not the batch. Other formats
(PNG, ...) are decoded by Pillow and copied over. torchvision is imported only on that path: the
CPU path needs Pillow alone. Pillow decodes on ``threads`` threads (it releases the GIL), and
on CUDA ``cpu_fraction`` of the JPEGs can go to them while nvJPEG decodes the rest.
``min_side`` lets Pillow decode a JPEG at 1/2, 1/4 or 1/8 scale (``Image.draft``) when its
shorter side stays >= ``min_side``: evaluation's resize to 256 of a 500x375 photo needs no
full-size decode.

A corrupt or truncated image is skipped and counted (`DecodeStats`), with a warning naming its
shard and key. A shard whose samples are all bad (every one this process decoded from it, and at
least ``min(16, shard size)`` of them) raises a DataError: that is a broken shard, not noise.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from hpctrain.data.images.reader import EncodedImages
from hpctrain.data.images.sniff import PILLOW_FORMATS, is_jpeg
from hpctrain.errors import DataError

log = logging.getLogger("hpctrain.data")

# Bad samples in a row from one shard, with none good, that prove the shard broken.
ALL_BAD_EVIDENCE = 16


class Decoded(list):
    """The decoded images (uint8 (3, H, W) tensors); ``kept``: each one's index in the batch."""

    def __init__(self, images: list[torch.Tensor], kept: list[int]):
        super().__init__(images)
        self.kept = kept


@dataclass
class DecodeStats:
    """Images decoded and skipped by this process, per shard (seen, bad), and time spent."""

    decoded: int = 0
    bad: int = 0
    shards: dict[str, list[int]] = field(default_factory=dict)
    decode_s: float = 0.0  # filled by a timed ImagePipeline
    augment_s: float = 0.0
    # CPU time of the threads that decoded and augmented (launching nvJPEG and the crop
    # kernels on CUDA): what the loader thread pays per batch, filled by ImagePipeline.
    decode_cpu_s: float = 0.0
    augment_cpu_s: float = 0.0

    def note(self, source: tuple[str, str, int], ok: bool, why: str = "") -> None:
        """Count one image; raise DataError once its shard has proven to be all bad."""
        shard, key, shard_samples = source
        seen_bad = self.shards.setdefault(shard, [0, 0])
        seen_bad[0] += 1
        if ok:
            self.decoded += 1
            return
        self.bad += 1
        seen_bad[1] += 1
        log.warning("skipping image %r of shard %r: it does not decode (%s)", key, shard, why)
        need = min(ALL_BAD_EVIDENCE, shard_samples) if shard_samples > 0 else ALL_BAD_EVIDENCE
        if seen_bad[0] == seen_bad[1] >= need:
            raise DataError(f"shard {shard!r}: all {seen_bad[1]} images read from it are corrupt "
                            f"(the last: {key!r}, {why})",
                            hint="run `hpctrain data verify` on the packed directory and pack "
                            "the images again")


def _pillow():
    try:
        from PIL import Image
    except ImportError:
        raise DataError("decoding images on the CPU needs Pillow, which is not installed",
                        hint="pip install pillow  (or: pip install 'hpctrain[images]')") from None
    return Image


def _pil_decode(data: torch.Tensor, min_side: int | None) -> torch.Tensor:
    """One image as uint8 (3, H, W) on the CPU; raises on a corrupt or truncated file."""
    Image = _pillow()
    # Only the raster formats a shard may hold: a shard is someone else's file, and Pillow's
    # EPS plugin (say) would run Ghostscript on an EPS file named x.jpg.
    with Image.open(io.BytesIO(data.numpy().tobytes()), formats=PILLOW_FORMATS) as img:
        if min_side and img.format == "JPEG":
            w, h = img.size
            s = min(w, h)
            if s > 2 * min_side:  # draft keeps both sides >= the request
                img.draft("RGB", (-(-w * min_side // s), -(-h * min_side // s)))
        rgb = np.array(img.convert("RGB"))  # a writable copy: torch shares its memory
    return torch.from_numpy(rgb).permute(2, 0, 1)


_warned_no_nvjpeg: list[bool] = []


def _nvjpeg(data: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """JPEGs decoded on ``device`` in one batch; None where an image fails alone too (and for
    all of them when torchvision is missing: Pillow decodes them then)."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as e:
        if not _warned_no_nvjpeg:
            _warned_no_nvjpeg.append(True)
            log.warning("decoding JPEGs with Pillow on the host: torchvision, which brings "
                        "nvJPEG, does not import (%s). HINT: pip install torchvision", e)
        return [None] * len(data)

    try:
        return list(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:  # one bad image fails the whole call: find it
        out: list[torch.Tensor | None] = []
        for d in data:
            try:
                out.append(decode_jpeg(d, mode=ImageReadMode.RGB, device=device))
            except RuntimeError:
                out.append(None)
        return out


def _cpu_or_none(data: torch.Tensor, min_side: int | None, contiguous: bool = False,
                 ) -> tuple[torch.Tensor | None, str]:
    """One image decoded by Pillow, or None and why not. ``contiguous``: as a (3, H, W) copy
    rather than Pillow's permuted HWC view (for the GPU: done by the decoding thread, in
    parallel, so that `to_device_packed` packs the batch in one plain copy)."""
    try:
        img = _pil_decode(data, min_side)
        return (img.contiguous() if contiguous else img), ""
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - Pillow raises OSError, SyntaxError, ValueError...
        return None, f"{type(e).__name__}: {e}"


_pools: dict[int, ThreadPoolExecutor] = {}


def _pool(threads: int) -> ThreadPoolExecutor:
    """A process-wide pool of Pillow decoding threads (Pillow decodes without the GIL)."""
    if threads not in _pools:
        _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="hpctrain-decode")
    return _pools[threads]


def to_device_packed(images: list[torch.Tensor], device: torch.device,
                     pin: bool | None = None) -> list[torch.Tensor]:
    """Host-decoded (3, H, W) images on ``device`` in one copy: packed contiguously into one
    host buffer (pinned for CUDA: a pageable copy may wait for the device, and the loader
    thread must not), sent at once, and viewed back as images. A pinned buffer per image cost
    ~10 ms each on an H200 host (the decode split ran at 270 img/s)."""
    if not images:
        return []
    for k, img in enumerate(images):
        # The buffer is uint8 and each part is viewed back as (3, H, W): anything else would
        # come back as other pixels, or fail in a view far from its cause.
        if img.dtype != torch.uint8 or img.dim() != 3:
            raise DataError(f"image {k} of the batch to send to {device} is a {img.dtype} "
                            f"tensor of shape {tuple(img.shape)}",
                            expected="uint8 (3, H, W) tensors, as Pillow's decode returns",
                            hint="decode with decode_batch, or convert the images to uint8 "
                            "(C, H, W) first")
    if pin is None:
        if device.type != "cuda":
            return [img.to(device) for img in images]  # the CPU path keeps Pillow's tensors
        pin = True
    sizes = [img.numel() for img in images]
    packed = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=pin)
    # One op for the batch (a copy per image was one more dispatch each, in the loader thread).
    # `decode_batch` has its Pillow threads make the images (3, H, W)-contiguous; a permuted
    # one is copied by reshape first.
    torch.cat([img.reshape(-1) for img in images], out=packed)
    moved = packed.to(device, non_blocking=True) if packed.device != device else packed
    return [part.view(img.shape) for img, part in zip(images, moved.split(sizes), strict=True)]


def decode_batch(images: EncodedImages | Sequence[torch.Tensor], device: str | torch.device,
                 *, min_side: int | None = None, stats: DecodeStats | None = None,
                 threads: int = 1, cpu_fraction: float = 0.0) -> Decoded:
    """Decode a batch of encoded images to uint8 (3, H, W) tensors on ``device``.

    ``threads``: Pillow decoding threads; ``cpu_fraction`` (CUDA): the share of the JPEGs that
    Pillow decodes on the host while nvJPEG decodes the rest, to split the work between the two.
    """
    batch = images if isinstance(images, EncodedImages) else EncodedImages(list(images))
    device = torch.device(device)
    stats = stats if stats is not None else DecodeStats()
    n = len(batch)
    out: list[torch.Tensor | None] = [None] * n
    why = [""] * n
    on_gpu: list[int] = []
    on_cuda = device.type == "cuda"  # the host-decoded images are packed for one copy there
    if on_cuda:
        # numpy slices the head: a torch slice per image would be one more op dispatched.
        jpegs = [i for i, d in enumerate(batch.data) if is_jpeg(d.numpy()[:3].tobytes())]
        on_gpu = jpegs[:len(jpegs) - round(len(jpegs) * cpu_fraction)]
    gpu = set(on_gpu)
    host = [i for i in range(n) if i not in gpu]
    # Host decodes start first, on the pool, so they overlap the nvJPEG call below (which
    # releases the GIL while it waits for the device): even a single thread's.
    if host and (threads > 1 and len(host) > 1 or on_gpu):
        pending = [_pool(threads).submit(_cpu_or_none, batch.data[i], min_side, on_cuda)
                   for i in host]
    else:
        pending = None
    if on_gpu:
        for i, img in zip(on_gpu, _nvjpeg([batch.data[i] for i in on_gpu], device), strict=True):
            out[i] = img
    decoded: dict[int, torch.Tensor] = {}
    for k, i in enumerate(host):
        img, why[i] = (pending[k].result() if pending is not None
                       else _cpu_or_none(batch.data[i], min_side, on_cuda))
        if img is not None:
            decoded[i] = img
    for i in on_gpu:  # refused by nvJPEG alone (CMYK, ...): Pillow's turn
        if out[i] is None:
            img, why[i] = _cpu_or_none(batch.data[i], min_side, on_cuda)
            if img is not None:
                decoded[i] = img
    for i, img in zip(decoded, to_device_packed(list(decoded.values()), device), strict=True):
        out[i] = img
    kept = []
    for i, img in enumerate(out):
        stats.note(batch.sources[i], img is not None, why[i])
        if img is not None:
            kept.append(i)
    return Decoded([out[i] for i in kept], kept)
