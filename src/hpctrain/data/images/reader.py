"""Packed images as a map-style dataset of encoded bytes and labels (decoding is batched later).

    ds = ImageShards("data/imagenet", split="train")        # or stage_to="$SLURM_TMPDIR"
    task = Task(model=..., data=ds, collate=collate_images, step=...)
    images, labels = batch                                   # EncodedImages, int64 labels

Through `hpctrain.data.samples.SampleLoader` (what `Task(data=...)` uses) the samples come in the
global deterministic order, with equal counts per rank and an exact resume position. The encoded
bytes stay in host memory (`EncodedImages` is no tensor container, so the loader does not move
it): nvJPEG reads its input from the host, and a JPEG is ~8x smaller than its pixels.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpctrain.data.images.sniff import IMAGE_EXTS
from hpctrain.data.tar_samples import MANIFEST, TarSamples
from hpctrain.errors import DataError

IMAGES_FORMAT = "hpctrain-images"
IMAGES_VERSION = 1
PACK_IMAGES_HINT = "run `hpctrain data pack-images SRC --out OUT` and read OUT"


class ImageSample(tuple):
    """``(bytes, label)`` of one sample: a uint8 1-D tensor and an int; it also knows its
    ``shard``, ``key`` and ``shard_samples``, which name it when it fails to decode."""

    def __new__(cls, data: torch.Tensor, label: int, shard: str = "?", key: str = "?",
                shard_samples: int = 0) -> ImageSample:
        self = super().__new__(cls, (data, label))
        self.shard, self.key, self.shard_samples = shard, key, shard_samples
        return self

    def __getnewargs__(self) -> tuple:
        """What pickle passes to ``__new__`` (tuple's own would pass the pair as ``data``)."""
        return (*self, self.shard, self.key, self.shard_samples)


@dataclass
class EncodedImages:
    """A batch of encoded images in host memory, with where each came from."""

    data: list[torch.Tensor]
    sources: list[tuple[str, str, int]] = field(default_factory=list)  # shard, key, shard size

    def __post_init__(self) -> None:
        if not self.sources:
            self.sources = [("?", f"#{i}", 0) for i in range(len(self.data))]

    def __len__(self) -> int:
        return len(self.data)


@dataclass
class PreparedImages:
    """An image batch already decoded and augmented on its device (`DecodeAhead`); like
    `EncodedImages` it is no tensor container, so the loader hands it over untouched."""

    tensor: torch.Tensor
    # Milliseconds per image (of the encoded batch) spent decoding and augmenting it: wall
    # time of the decode (nvJPEG returns when done), the side stream's events for the augment
    # on CUDA; None where not measured (augmenting in the step on CUDA would need a sync).
    decode_ms: float | None = None
    augment_ms: float | None = None
    # Mixup/CutMix (`Mixing`): the weight of the batch's own labels (their partners' is 1 - it).
    lam: float | None = None
    # A CUDA event recorded on the side stream once the batch is made (None: ready already).
    ready: Any = None

    def __len__(self) -> int:
        return self.tensor.shape[0]

    def use(self) -> torch.Tensor:
        """The batch, safe to read on the current stream: the stream (not the host) waits for
        the side stream that made it, and the allocator keeps its memory until this stream is
        done with it."""
        if self.ready is not None:
            stream = torch.cuda.current_stream(self.tensor.device)
            stream.wait_event(self.ready)
            self.tensor.record_stream(stream)
        return self.tensor


def collate_images(samples: list) -> tuple[EncodedImages, torch.Tensor]:
    """``(EncodedImages, int64 labels)`` of ``(bytes, label)`` samples (`ImageShards` items)."""
    sources = [(getattr(s, "shard", "?"), getattr(s, "key", f"#{i}"),
                getattr(s, "shard_samples", 0)) for i, s in enumerate(samples)]
    return (EncodedImages([s[0] for s in samples], sources),
            torch.tensor([int(s[1]) for s in samples], dtype=torch.int64))


def read_manifest(root: Path) -> dict:
    """``root/manifest.json`` as JSON (a pack's or one split's), or a DataError saying why not."""
    try:
        return json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {str(root / MANIFEST)!r}: {e}",
                        hint=PACK_IMAGES_HINT) from None


def split_dir(path: str | Path, split: str) -> Path:
    """The directory of ``split`` in a `pack_images` output (or ``path`` if it is one split)."""
    root = Path(path)
    raw = read_manifest(root)
    if raw.get("format") != IMAGES_FORMAT:  # a split directory itself (hpctrain-tar + classes)
        if raw.get("split", split) != split:
            raise DataError(f"{str(root)!r} is the {raw['split']!r} split, not {split!r}",
                            hint=f"pass split={raw['split']!r}, or the folder above it")
        return root
    splits = raw.get("splits") or {}
    if split not in splits:
        raise DataError(f"{str(root)!r} has no split {split!r}",
                        expected=f"one of {', '.join(sorted(splits)) or '(none)'}",
                        hint="pack with --val-fraction or a val/ folder for a val split")
    return root / split


class ImageShards:
    """Sample ``i`` of a packed image split as ``(uint8 bytes tensor, label)``, not decoded."""

    def __init__(self, path: str | Path, split: str = "train", *, stage_to: str | None = None,
                 local_rank: int | None = None, window_shards: int = 4):
        """``stage_to``: copy the split once per node to node-local disk (`data.staging`)."""
        root = split_dir(path, split)
        if stage_to:
            from hpctrain.data.staging import stage_dataset
            from hpctrain.runtime.env import detect_env

            rank = detect_env().local_rank if local_rank is None else local_rank
            root = stage_dataset(root, stage_to, rank)
        self.root = root
        self._tar = TarSamples(root, window_shards=window_shards)
        raw = self._tar.raw
        classes = raw.get("classes")
        if not isinstance(classes, list) or not classes:
            raise DataError(f"{str(root / MANIFEST)!r} lists no image classes",
                            hint=PACK_IMAGES_HINT)
        self.classes: list[str] = [str(c) for c in classes]
        self.split = raw.get("split", split)
        self.shard_sample_counts: np.ndarray = self._tar.shard_sample_counts
        self.window_shards = window_shards

    def __len__(self) -> int:
        return len(self._tar)

    def __getitem__(self, i: int) -> ImageSample:
        """``(bytes, label)`` of sample ``i``."""
        return self.read_samples([int(i)])[0]

    def read_samples(self, indices: list[int]) -> list[ImageSample]:
        """Samples ``indices`` in one call: reading draws no random numbers, so `SampleLoader`
        reads a micro-batch here without seeding each sample."""
        return [self._sample(*read) for read in self._tar.read_many(indices)]

    def _sample(self, s: int, key: str, members: dict[str, memoryview]) -> ImageSample:
        """The sample ``key`` of shard number ``s`` from its members' bytes."""
        shard = self._tar.raw["shards"][s]["tar"]
        exts = [e for e in members if e in IMAGE_EXTS]
        if len(exts) != 1 or "cls" not in members:
            raise DataError(f"sample {key!r} of {str(self.root / shard)!r} has members "
                            f"{sorted(members)}",
                            expected="one image (jpg, png, ...) and a cls", hint=PACK_IMAGES_HINT)
        try:
            label = int(bytes(members["cls"]))
        except ValueError:
            raise DataError(f"sample {key!r} of {str(self.root / shard)!r} has label "
                            f"{bytes(members['cls'][:20])!r}",
                            expected="an integer class index") from None
        if not 0 <= label < len(self.classes):
            raise DataError(f"sample {key!r} of {str(self.root / shard)!r} has label {label}",
                            expected=f"0 <= label < {len(self.classes)} (the classes)")
        # The member is a writable view of the sample's read buffer: no copy.
        data = torch.frombuffer(members[exts[0]], dtype=torch.uint8)
        return ImageSample(data, label, shard, key, int(self.shard_sample_counts[s]))

    def close(self) -> None:
        """Close the open shard files."""
        self._tar.close()
