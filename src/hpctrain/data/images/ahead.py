"""Decode and augment in the loader's prefetch thread, so that it overlaps the training step.

    pipe = ImagePipeline(224, train=True, device="cuda", dtype=torch.bfloat16)
    task = Task(model=..., data=ImageShards(...), collate=DecodeAhead(pipe, seed), step=...)
    # in the step: images, labels = pipe(*batch)   (a PreparedImages batch passes through)

`hpctrain.data.samples.SampleLoader` runs the collate's two parts on two threads, a step or two
ahead of training: ``gather`` (the encoded bytes and labels) beside the reading of the shards,
``finish`` (decode + augment) on the next thread, so reading batch k+1 overlaps decoding batch
k. Done there, nvJPEG decoding and the crops run on CUDA side streams while the
model's kernels run on the default stream (Pillow and PyTorch's CPU kernels release the GIL, so
on the CPU it overlaps too). The thread never waits for the GPU: the batch carries an event
recorded on the side stream once it is made, and the step's stream waits for that event
(`PreparedImages.use`: on the device, not the host) and records the memory as its own, so the
allocator does not give it back to the side stream while the step still reads it. The side
stream's timing of each augment is read once its events have completed (``query``, no wait):
a batch reports the timing of an earlier one.

Decoding has a stream of its own. torchvision's ``decode_jpeg(device="cuda")`` allocates its
outputs on the caller's current stream but writes them on a stream of its own pool, which waits
for nothing of ours (it syncs that stream on the host before and after, then makes the caller's
stream wait for it). Decoded under the crops' stream, batch k+1's outputs could take the blocks
of batch k's images, freed while batch k's crops are still queued there, and be overwritten
before those crops ran. So the images are allocated on the decode stream, the crops' stream
waits for it, and the batch's images are kept (with the crops' end event) until that event has
completed: their blocks go back to the decode stream only once the crops that read them have
run, seen by ``query`` at a later batch (no host wait). Not ``record_stream`` per image: each of
those 256 calls a batch let go of the GIL and took it back from the training thread.

The crops cannot come from a generator seeded by the step (the collate does not know it): they
come from one seeded by the run seed and the keys of the batch's samples. A resumed run reads the
same batches in the same order (the global order), so it crops them the same way.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque

import torch

from hpctrain.data.images.augment import ImagePipeline
from hpctrain.data.images.mix import Mixing
from hpctrain.data.images.reader import EncodedImages, PreparedImages, collate_images


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
    augmented by ``pipeline`` in the loader's thread.

    ``side_stream=False`` is for `prepare` called in the training step itself (decoding on the
    step's own stream, serially: the baseline that decoding ahead is measured against).
    ``mixing`` (training only) mixes each batch after its crops, from the same generator.

    A batch that lost images (they do not decode) keeps its size: the kept images' crops, in
    turn, fill the missing rows after them, so a compiled model sees one shape and does not
    recompile; the labels are those of the kept images only, and the step counts the rows
    that have one (a copy of a real image, not zeros, so BatchNorm's batch statistics stay
    those of real pixels).
    """

    def __init__(self, pipeline: ImagePipeline, seed: int, *, side_stream: bool = True,
                 mixing: Mixing | None = None):
        self.pipeline = pipeline
        self.seed = seed
        self.side_stream = side_stream
        self.mixing = mixing
        self._streams: tuple | None = None  # (decode, crops) on CUDA, made at first use
        # (begin, end, images, decoded) of augments whose events the device has not reached
        # yet: the decoded images are freed when popped (`prepare`).
        self._timings: deque = deque()
        # The training loader's thread and validation's read-ahead thread may share this
        # collate: the streams are made once, and the timings popped by one of them.
        self._lock = threading.Lock()

    def __call__(self, samples: list) -> tuple[PreparedImages, torch.Tensor]:
        """The prepared batch and its labels (those of the images that decoded)."""
        return self.finish(self.gather(samples))

    def gather(self, samples: list) -> tuple[EncodedImages, torch.Tensor]:
        """The host part: encoded bytes and labels (`SampleLoader` runs it on the reading
        thread, and `finish` on another)."""
        return collate_images(samples)

    def finish(self, gathered: tuple[EncodedImages, torch.Tensor],
               ) -> tuple[PreparedImages, torch.Tensor]:
        """The device part: `prepare` of what `gather` made."""
        return self.prepare(*gathered)

    def prepare(self, encoded: EncodedImages, labels: torch.Tensor,
                ) -> tuple[PreparedImages, torch.Tensor]:
        """``encoded`` decoded and augmented (crops seeded by its sample keys), with the
        milliseconds per image each part took, and the labels of the images kept."""
        g = batch_generator(self.seed, encoded.sources)
        pipe = self.pipeline
        n = len(encoded)
        if pipe.device.type != "cuda" or not self.side_stream:
            t0 = time.perf_counter()
            out = pipe.decode(encoded)
            t1 = time.perf_counter()
            x, kept = pipe.augment(out, g)
            x, lam = self._mix(x, g)
            # On CUDA the augment's kernels are still queued here: timing them would need a
            # sync of the step's stream, so only the decode (nvJPEG returns when done) counts.
            augment = (wall_ms_per_image(t1, time.perf_counter(), n)
                       if x.device.type == "cpu" else None)
            return (PreparedImages(_pad(x, n), wall_ms_per_image(t0, t1, n), augment, lam),
                    _kept(labels, kept))
        decode_stream, crop_stream = self.cuda_streams()
        # This thread's current device is cuda:0 whatever the rank's is: set both.
        with torch.cuda.device(pipe.device):
            with torch.cuda.stream(decode_stream):
                t0 = time.perf_counter()
                out = pipe.decode(encoded)
                t1 = time.perf_counter()
            crop_stream.wait_stream(decode_stream)
            with torch.cuda.stream(crop_stream):
                begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                begin.record()
                x, kept = pipe.augment(out, g)
                x, lam = self._mix(x, g)
                x = _pad(x, n)
                end.record()  # also the batch's "ready" event
        with self._lock:  # the images, kept until the crops that read them have run
            self._timings.append((begin, end, n, out))
        return (PreparedImages(x, wall_ms_per_image(t0, t1, n), self._done_augment_ms(), lam,
                               ready=end), _kept(labels, kept))

    def cuda_streams(self) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
        """The (decode, crops) side streams on the pipeline's device, made at the first call.

        The crops read the pipeline's constants (normalisation), which the default stream
        computed when the pipeline was built, maybe still queued: both streams start after
        what that stream has queued so far."""
        with self._lock:
            if self._streams is None:
                device = self.pipeline.device
                made_on = torch.cuda.default_stream(device)
                self._streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
                for stream in self._streams:
                    stream.wait_stream(made_on)
            return self._streams

    def _done_augment_ms(self) -> float | None:
        """Milliseconds per image of the latest augment the device has finished (None if none
        has since the last call), freeing the decoded images of those finished; never waits."""
        ms = None
        with self._lock:  # checked and popped as one: another thread may pop the same entry
            while self._timings and self._timings[0][1].query():
                begin, end, n, _ = self._timings.popleft()
                ms = event_ms_per_image(begin, end, n)
        return ms

    def _mix(self, x: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, float | None]:
        if self.mixing is None or not self.pipeline.train:
            return x, None
        x, lam = self.mixing(x, g)
        return x.contiguous(memory_format=torch.channels_last), lam


def wall_ms_per_image(start: float, stop: float, n: int) -> float:
    """Milliseconds per image of a batch of ``n`` timed by ``time.perf_counter`` (seconds)."""
    return (stop - start) * 1e3 / max(1, n)


def event_ms_per_image(begin, end, n: int) -> float:
    """Milliseconds per image of a batch of ``n`` timed by two recorded CUDA events (their
    ``elapsed_time`` is in milliseconds already)."""
    return begin.elapsed_time(end) / max(1, n)


def _pad(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` with copies of its images, in turn, appended up to ``n`` rows (none if it has no
    image: an all-corrupt batch stays empty). In turn, not the first one ``missing`` times:
    BatchNorm's statistics should not lean on one image."""
    missing, k = n - x.shape[0], x.shape[0]
    if missing <= 0 or k == 0:
        return x
    return torch.cat([x, x[torch.arange(missing, device=x.device) % k]]).contiguous(
        memory_format=torch.channels_last)


def _kept(labels: torch.Tensor, kept: list[int]) -> torch.Tensor:
    """The labels of the images that decoded (all of them, as a rule: no indexing then)."""
    return labels if len(kept) == len(labels) else labels[kept]
