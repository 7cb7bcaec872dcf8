"""Synthetic JPEGs at ImageNet-like sizes, for throughput without downloads.

    hpctrain data synth-images --out /tmp/synth --count 20000 --classes 100

``OUT/cNNN/NNNNNNNN.jpg`` in ImageFolder layout (so ``data pack-images OUT`` packs it): 500x375
at quality 90 by default, ~94 kB each (issue 32's anchor images: 93 kB). The pixels are
structured noise (a smooth colour field plus noise at a few scales) because JPEG sizes, and so
decoding costs, depend on content: flat images would be tiny, white noise far too big. Image
``i`` depends only on (seed, i): the same call writes the same files, in any number of
processes.
"""

from __future__ import annotations

import io
import multiprocessing
import os
import sys
import threading
from pathlib import Path

import numpy as np

from hpctrain.data.shards import atomic_write, make_out_dir


def synthetic_jpeg(i: int, seed: int = 0, size: tuple[int, int] = (500, 375),
                   quality: int = 90) -> bytes:
    """The JPEG bytes of synthetic image ``i`` (``size`` is width, height)."""
    from PIL import Image

    rng = np.random.default_rng([seed, i])
    w, h = size
    field = np.zeros((h, w, 3), dtype=np.float32)
    # Noise at 1/32, 1/8 and 1/2 of the resolution, upsampled: edges and texture, not static.
    for div, amp in ((32, 90.0), (8, 40.0), (2, 40.0)):
        small = rng.normal(0, amp, (max(1, h // div), max(1, w // div), 3)).astype(np.float32)
        layers = [np.asarray(Image.fromarray(small[..., c], mode="F").resize(
            (w, h), Image.BILINEAR)) for c in range(3)]
        field += np.stack(layers, axis=-1)
    field += rng.uniform(40, 215, 3).astype(np.float32)  # a colour cast per image
    pixels = np.clip(field, 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _write_one(job: tuple[Path, int, int, int, tuple[int, int], int]) -> int:
    out, i, classes, seed, size, quality = job
    path = out / f"c{i % classes:03d}" / f"{i:08d}.jpg"
    data = synthetic_jpeg(i, seed, size, quality)
    atomic_write(path, [data])
    return len(data)


def write_synthetic_jpegs(out: str | Path, count: int, classes: int = 10, *, seed: int = 0,
                          size: tuple[int, int] = (500, 375), quality: int = 90,
                          workers: int | None = None) -> int:
    """Write ``count`` JPEGs into ``out`` (``classes`` folders); return the total bytes."""
    out = make_out_dir(Path(out))
    for c in range(min(classes, count)):
        (out / f"c{c:03d}").mkdir(exist_ok=True)
    jobs = [(out, i, classes, seed, size, quality) for i in range(count)]
    workers = min(workers or len(os.sched_getaffinity(0)), count)
    if workers <= 1:
        return sum(map(_write_one, jobs))
    # fork while single-threaded (the CLI), as `data prepare` does: no re-import of torch per
    # worker; spawn otherwise.
    single = threading.active_count() == 1 and sys.platform == "linux"
    with multiprocessing.get_context("fork" if single else "spawn").Pool(workers) as pool:
        return sum(pool.imap_unordered(_write_one, jobs, chunksize=16))
