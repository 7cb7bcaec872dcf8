"""Decode, crop, flip and normalise a batch on its device: the same torch code on CPU and CUDA.

    pipe = ImagePipeline(224, train=True, device="cuda", dtype=torch.bfloat16)
    g = augment_generator(seed, step, rank)        # resume replays the same crops
    x, y = pipe(images, labels, g)                 # x: (B, 3, 224, 224) channels_last bf16

Training: torchvision's RandomResizedCrop (area scale (0.08, 1), aspect ratio (3/4, 4/3) drawn
log-uniformly, 10 tries, else a centre crop of the clamped ratio) + horizontal flip with p=0.5;
evaluation: resize the shorter side to ``resize`` (default size / 0.875: 256 for 224) and take the
centre ``size`` x ``size``. On CUDA the whole batch is cropped, resized (bilinear, antialiased:
``F.interpolate``'s weights) and flipped by `crop_kernel.batch_crops` in a fixed number of
kernel launches; on the CPU each crop goes through PyTorch's uint8 ``F.interpolate`` on its own
(~20x faster there than the batched float kernel), then stacked. Normalisation runs on the batch.

Every random number comes from the ``torch.Generator`` passed in (a CPU generator: the crop
boxes are needed on the host to slice), a fixed count per image, so a resumed run that builds
the generator from the same (seed, step, rank) crops bit-identically.
"""

from __future__ import annotations

import hashlib
import math
import time

import numpy as np
import torch
import torch.nn.functional as F

from hpctrain.data.images.crop_kernel import batch_crops, centre_geometry, train_geometry
from hpctrain.data.images.decode import Decoded, DecodeStats, decode_batch
from hpctrain.data.images.reader import EncodedImages, PreparedImages

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_TRIES = 10


def augment_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """A CPU generator seeded by (run seed, step, rank): the same crops after a resume."""
    digest = hashlib.sha256(f"hpctrain-augment:{seed}:{step}:{rank}".encode()).digest()
    g = torch.Generator()
    g.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return g


def crop_boxes(sizes: list[tuple[int, int]], generator: torch.Generator,
               scale: tuple[float, float] = (0.08, 1.0),
               ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> list[tuple[int, int, int, int]]:
    """RandomResizedCrop boxes ``(top, left, height, width)`` for images of ``(H, W)`` sizes.

    All tries of the batch at once in numpy (the loader thread holds the GIL through Python
    loops: 1.2 ms a batch of 256 image by image), with the same float64 arithmetic as
    torchvision's per-image loop, ``math.exp`` included: the same boxes, bit for bit."""
    n = len(sizes)
    u = torch.rand((n, _TRIES, 4), generator=generator, dtype=torch.float64).numpy()
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    hw = np.array(sizes, dtype=np.int64).reshape(n, 2)
    height, width = hw[:, :1], hw[:, 1:]
    target = (height * width) * (scale[0] + (scale[1] - scale[0]) * u[..., 0])
    # math.exp, not np.exp: numpy's differs in the last bit for ~5% of arguments.
    exponent = (log_lo + (log_hi - log_lo) * u[..., 1]).ravel().tolist()
    aspect = np.fromiter(map(math.exp, exponent), np.float64, len(exponent)).reshape(n, _TRIES)
    w = np.rint(np.sqrt(target * aspect)).astype(np.int64)  # round half to even, as round()
    h = np.rint(np.sqrt(target / aspect)).astype(np.int64)
    fits = (w > 0) & (w <= width) & (h > 0) & (h <= height)
    rows = np.arange(n)
    first = fits.argmax(1)  # the first try that fits
    h, w = h[rows, first], w[rows, first]
    height, width = height[:, 0], width[:, 0]
    # Uniform over the (H - h + 1) x (W - w + 1) positions, as torch.randint.
    top = np.minimum((u[rows, first, 2] * (height - h + 1)).astype(np.int64), height - h)
    left = np.minimum((u[rows, first, 3] * (width - w + 1)).astype(np.int64), width - w)
    boxes = list(zip(top.tolist(), left.tolist(), h.tolist(), w.tolist(), strict=True))
    for k in np.flatnonzero(~fits.any(1)).tolist():
        # No try fits: torchvision's fallback, the centre at the ratio clamped into range.
        H, W = sizes[k]
        in_ratio = W / H
        if in_ratio < min(ratio):
            cw, ch = W, round(W / min(ratio))
        elif in_ratio > max(ratio):
            cw, ch = round(H * max(ratio)), H
        else:
            cw, ch = W, H
        boxes[k] = ((H - ch) // 2, (W - cw) // 2, ch, cw)
    return boxes


def _resize(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """uint8 (3, h, w) -> (3, H, W), bilinear with antialiasing: uint8 on the CPU, float32 on
    CUDA (callers stack, then convert the batch once)."""
    if img.device.type == "cpu":
        # PyTorch's uint8 kernel on the CPU is ~20x faster than float32 (one 224 crop: 0.6 ms
        # vs 14 ms); it rounds to whole levels, as torchvision's tensor transforms do. CUDA has
        # no uint8 antialiased kernel.
        return F.interpolate(img[None], size=size, mode="bilinear", antialias=True,
                             align_corners=False)[0]
    return F.interpolate(img[None].float(), size=size, mode="bilinear", antialias=True,
                         align_corners=False)[0]


class ImagePipeline:
    """Encoded images + labels -> normalised ``channels_last`` image batch + labels, on device."""

    def __init__(self, size: int = 224, *, train: bool = True,
                 device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 resize: int | None = None, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3), flip: bool = True,
                 mean: tuple[float, ...] = IMAGENET_MEAN, std: tuple[float, ...] = IMAGENET_STD,
                 threads: int = 1, cpu_fraction: float = 0.0, min_side: int | None = None,
                 timed: bool = False, batched: bool | None = None):
        """``resize``: evaluation's shorter side before the centre crop (default size / 0.875);
        ``threads``, ``cpu_fraction``: Pillow threads and their share on CUDA (`decode_batch`);
        ``min_side`` (training): Pillow decodes JPEGs at reduced size while their shorter side
        stays >= it (evaluation always does so for ``resize``); ``timed``: add the seconds
        spent decoding and augmenting to ``stats`` (this waits for the device after each part,
        so leave it off in training); ``batched``: crop the batch in one go (`batch_crops`;
        default: on CUDA) rather than image by image (the CPU's fastest way)."""
        if size < 1:
            raise ValueError(f"size {size} must be >= 1")
        self.size = size
        self.train = train
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" means this thread's current device; `DecodeAhead` runs in another thread,
            # whose current device is cuda:0, so pin the one this rank chose now.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype
        self.resize = resize or round(size / 0.875)
        if self.resize < size:
            raise ValueError(f"resize {self.resize} must be >= size {size}")
        self.scale, self.ratio, self.flip = scale, ratio, flip
        # Normalising is x * scale + shift per channel (0..255 levels in): one fused op.
        std255 = torch.tensor(std, device=self.device).view(1, 3, 1, 1) * 255
        self._scale = 1 / std255
        self._shift = -torch.tensor(mean, device=self.device).view(1, 3, 1, 1) * 255 / std255
        self.threads, self.cpu_fraction, self.timed = threads, cpu_fraction, timed
        self.min_side = min_side if train else self.resize
        self.stats = DecodeStats()
        self.batched = self.device.type == "cuda" if batched is None else batched
        # float16 holds every uint8 level exactly and halves the batched kernel's traffic on
        # CUDA; the CPU has no fast float16 matmul.
        self._compute = torch.float16 if self.device.type == "cuda" else torch.float32

    def __call__(self, images: EncodedImages | PreparedImages | list[torch.Tensor],
                 labels: torch.Tensor, generator: torch.Generator | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(images (B', 3, S, S), labels (B',))``; B' < B when corrupt images were skipped.

        `PreparedImages` (from `DecodeAhead`, done in the loader's thread) pass through.
        """
        if isinstance(images, PreparedImages):
            return images.use(), labels.to(self.device, non_blocking=True)
        x, kept = self.prepare(images, generator)
        labels = labels.to(self.device, non_blocking=True)
        if len(kept) < len(labels):
            labels = labels[torch.tensor(kept, dtype=torch.long, device=self.device)]
        return x, labels

    def prepare(self, images: EncodedImages | list[torch.Tensor],
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, list[int]]:
        """The image batch and, for each image, its index in ``images`` (labels follow it)."""
        return self.augment(self.decode(images), generator)

    def _clock(self) -> float:
        if self.timed and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return time.perf_counter()

    def decode(self, images: EncodedImages | list[torch.Tensor]) -> Decoded:
        """The images that decode, as uint8 (3, H, W) tensors on the device (`decode_batch`)."""
        t0, cpu0 = self._clock(), time.thread_time()
        out = decode_batch(images, self.device, min_side=self.min_side, stats=self.stats,
                           threads=self.threads, cpu_fraction=self.cpu_fraction)
        self.stats.decode_cpu_s += time.thread_time() - cpu0
        if self.timed:
            self.stats.decode_s += self._clock() - t0
        return out

    def augment(self, out: Decoded, generator: torch.Generator | None,
                ) -> tuple[torch.Tensor, list[int]]:
        """Crops (random in training, centred in evaluation), flips, normalisation: the batch
        and, for each image, its index in the encoded batch."""
        if self.train and generator is None:
            raise ValueError("training augmentation needs an explicit torch.Generator "
                             "(augment_generator(seed, step, rank)), so a resume is exact")
        t0, cpu0 = self._clock(), time.thread_time()
        x, kept = self._augment(out, generator)
        self.stats.augment_cpu_s += time.thread_time() - cpu0
        if self.timed:
            self.stats.augment_s += self._clock() - t0
        return x, kept

    def _augment(self, out: Decoded, generator: torch.Generator | None,
                 ) -> tuple[torch.Tensor, list[int]]:
        S = self.size
        if not out:
            return (torch.empty((0, 3, S, S), device=self.device, dtype=self.dtype)
                    .contiguous(memory_format=torch.channels_last), [])
        if self.train:
            x = self._train_crops(out, generator)
        elif self.batched:
            x = batch_crops(out, [centre_geometry(tuple(img.shape[-2:]), self.resize, S)
                                  for img in out], S, self._compute)
        else:
            x = torch.stack([self._centre(img) for img in out])
        # One pass: normalised, in the dtype asked, channels_last (torch computes in float32).
        normed = torch.empty(x.shape, dtype=self.dtype, device=self.device,
                             memory_format=torch.channels_last)
        return torch.addcmul(self._shift, x, self._scale, out=normed), out.kept

    def _train_crops(self, images: list[torch.Tensor], g: torch.Generator) -> torch.Tensor:
        sizes = [tuple(img.shape[-2:]) for img in images]
        boxes = crop_boxes(sizes, g, self.scale, self.ratio)
        # Drawn whether or not flips are on: the generator's later draws (mixing) stay put.
        # A host list: which samples flip never travels to the device on its own.
        flips = (torch.rand(len(images), generator=g) < 0.5).tolist()
        if not self.flip:
            flips = [False] * len(images)
        if self.batched:
            return batch_crops(images, [train_geometry(hw, box, self.size, f) for hw, box, f
                                        in zip(sizes, boxes, flips, strict=True)],
                               self.size, self._compute)
        crops = (_resize(img[:, t:t + h, lf:lf + w], (self.size, self.size))
                 for img, (t, lf, h, w) in zip(images, boxes, strict=True))
        return torch.stack([c.flip(-1) if f else c for c, f in zip(crops, flips, strict=True)])

    def _centre(self, img: torch.Tensor) -> torch.Tensor:
        """torchvision's Resize(resize) + CenterCrop(size) of one image."""
        h, w = img.shape[-2:]
        r = self.resize
        nh, nw = (r, int(r * w / h)) if h <= w else (int(r * h / w), r)
        x = _resize(img, (nh, nw))
        top, left = round((nh - self.size) / 2), round((nw - self.size) / 2)
        return x[:, top:top + self.size, left:left + self.size]
