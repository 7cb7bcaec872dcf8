"""The image loader's own throughput: read, decode and augment packed images, no model.

    from hpctrain.data.images.throughput import loader_throughput
    print(loader_throughput("data/synth", device="cuda", dtype=torch.bfloat16, threads=8))

Reading runs as in training: `SampleLoader` in the global order, its prefetch thread reading
the shards while the caller's thread decodes and augments (on the GPU when ``device`` is CUDA);
with ``ahead=True`` a second loader thread decodes and augments (`DecodeAhead`), as training
does, and the batches' own timings are reported (nvJPEG's wall time, the side stream's events).
``timed=True`` (without ``ahead``) splits the time into decoding and augmenting by waiting for
the device after each part. Either way the row says the CPU time per batch of the loader's
threads: reading (shards + gathering), decoding (launching nvJPEG, or Pillow) and cropping
(launching the crop kernels): where a loader bound by its host threads spends its time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from hpctrain.data.images.ahead import DecodeAhead
from hpctrain.data.images.augment import ImagePipeline, augment_generator
from hpctrain.data.images.reader import ImageShards, PreparedImages, collate_images
from hpctrain.data.order import BatchLayout
from hpctrain.data.samples import SampleLoader


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def loader_throughput(path: str | Path, *, split: str = "train", batch: int = 256,
                      steps: int = 10, warmup: int = 2, size: int = 224, train: bool = True,
                      device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                      threads: int = 1, cpu_fraction: float = 0.0, seed: int = 0,
                      min_side: int | None = None, ahead: bool = False,
                      timed: bool = False, batched: bool | None = None) -> dict:
    """Images/s through read + decode + augment, and the seconds each part took per batch
    (``min_side``: decode at reduced size, ``batched``: the batched crop kernel, as
    `ImagePipeline`'s)."""
    if timed and ahead:
        raise ValueError("timed=True waits for the device inside the loader thread: "
                         "ahead=True reports the batches' own timings instead")
    device = torch.device(device)
    ds = ImageShards(path, split)
    pipe = ImagePipeline(size, train=train, device=device, dtype=dtype, threads=threads,
                         cpu_fraction=cpu_fraction, min_side=min_side, timed=timed,
                         batched=batched)
    collate = DecodeAhead(pipe, seed) if ahead else collate_images
    loader = SampleLoader(ds, BatchLayout(batch, 1, 1, 0), seed, device, collate, prefetch=2)
    wait = work = 0.0
    images = 0
    ms: dict[str, list[float]] = {"decode": [], "augment": []}
    try:
        for step in range(warmup + steps):
            if step == warmup:
                _sync(device)
                wait = work = 0.0
                images = 0
                st = pipe.stats
                before = (st.decode_s, st.augment_s, st.decoded + st.bad, st.decode_cpu_s,
                          st.augment_cpu_s, loader.read_cpu_s, loader.sampler.step)
                t_start = time.perf_counter()
            t0 = time.perf_counter()
            encoded, labels = loader.next_step()[0]
            t1 = time.perf_counter()
            if isinstance(encoded, PreparedImages) and step >= warmup:
                for name, value in (("decode", encoded.decode_ms),
                                    ("augment", encoded.augment_ms)):
                    if value is not None:
                        ms[name].append(value)
            _, kept = pipe(encoded, labels, augment_generator(seed, step, 0))
            _sync(device)
            wait += t1 - t0
            work += time.perf_counter() - t1
            images += len(kept)  # a batch ahead is padded to its size: its labels are not
        total = time.perf_counter() - t_start
    finally:
        loader.close()
        ds.close()
    st = pipe.stats
    n = max(1, st.decoded + st.bad - before[2])  # with ahead=True: also what was prefetched
    read_batches = max(1, loader.sampler.step - before[6])
    timing = ({"decode_ms_per_image": (st.decode_s - before[0]) / n * 1e3,
               "augment_ms_per_image": (st.augment_s - before[1]) / n * 1e3} if timed else
              {f"{k}_ms_per_image": sum(v) / len(v) for k, v in ms.items() if v})
    return {"images_per_s": images / total, "images": images, "seconds": total,
            "loader_wait_s_per_batch": wait / steps, "step_s_per_batch": work / steps,
            "read_cpu_ms_per_batch": (loader.read_cpu_s - before[5]) / read_batches * 1e3,
            "decode_cpu_ms_per_batch": (st.decode_cpu_s - before[3]) / n * batch * 1e3,
            "crop_cpu_ms_per_batch": (st.augment_cpu_s - before[4]) / n * batch * 1e3,
            "device": str(device), "threads": threads, "cpu_fraction": cpu_fraction,
            "ahead": ahead, "cpus": len(os.sched_getaffinity(0)), "batch": batch, "size": size,
            "train": train, "batched_crops": pipe.batched, "skipped_images": pipe.stats.bad,
            **timing}
