"""Decode and augment in the loader's prefetch thread, so that it overlaps the training step.

    pipe = ImagePipeline(224, train=True, device="cuda", dtype=torch.bfloat16)
    task = Task(model=..., data=ImageShards(...), collate=DecodeAhead(pipe, seed), step=...)
    # in the step: images, labels = pipe(*batch)   (a PreparedImages batch passes through)

`hpctrain.data.samples.SampleLoader` runs ``collate`` in its prefetch thread, a step or two ahead
of training. Done there, nvJPEG decoding and the crops run on a CUDA side stream while the
model's kernels run on the default stream (Pillow and PyTorch's CPU kernels release the GIL, so
on the CPU it overlaps too). The batch is complete before it is handed over (the thread waits
on its stream), and its memory is recorded as used by the default stream, so the allocator does
not give it back to the side stream while the step still reads it.

The crops cannot come from a generator seeded by the step (the collate does not know it): they
come from one seeded by the run seed and the keys of the batch's samples. A resumed run reads the
same batches in the same order (the global order), so it crops them the same way.
"""

from __future__ import annotations

import hashlib

import torch

from hpctrain.data.images.augment import ImagePipeline
from hpctrain.data.images.reader import PreparedImages, collate_images


def batch_generator(seed: int, sources: list[tuple[str, str, int]]) -> torch.Generator:
    """A CPU generator seeded by the run seed and the batch's (shard, key)s."""
    h = hashlib.sha256(f"hpctrain-augment:{seed}".encode())
    for shard, key, _ in sources:
        h.update(f"\0{shard}\0{key}".encode())
    g = torch.Generator()
    g.manual_seed(int.from_bytes(h.digest()[:8], "little") & ((1 << 63) - 1))
    return g


class DecodeAhead:
    """A ``collate`` for `ImageShards` that returns ``(PreparedImages, labels)``, decoded and
    augmented by ``pipeline`` in the loader's thread."""

    def __init__(self, pipeline: ImagePipeline, seed: int):
        self.pipeline = pipeline
        self.seed = seed
        self._stream = None

    def __call__(self, samples: list) -> tuple[PreparedImages, torch.Tensor]:
        """The prepared batch and its labels (those of the images that decoded)."""
        encoded, labels = collate_images(samples)
        g = batch_generator(self.seed, encoded.sources)
        device = self.pipeline.device
        if device.type != "cuda":
            x, kept = self.pipeline.prepare(encoded, g)
            return PreparedImages(x), labels[kept]
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        # This thread's current device is cuda:0 whatever the rank's is: set both.
        with torch.cuda.device(device), torch.cuda.stream(self._stream):
            x, kept = self.pipeline.prepare(encoded, g)
        x.record_stream(torch.cuda.default_stream(device))
        self._stream.synchronize()
        return PreparedImages(x), labels[kept]
