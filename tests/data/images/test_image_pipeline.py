"""Decoding (CPU path), corrupt images, augmentation and the loader's order over image shards."""

from __future__ import annotations

import contextlib
import io
import logging
import math
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from image_trees import image_tree_fixture, tiny_jpeg  # noqa: F401 (the image_tree fixture)
from PIL import Image

from hpctrain.data.images import (
    DecodeAhead,
    DecodeStats,
    EncodedImages,
    ImagePipeline,
    ImageShards,
    augment_generator,
    collate_images,
    crop_boxes,
    decode_batch,
)
from hpctrain.data.images.ahead import event_ms_per_image, wall_ms_per_image
from hpctrain.data.images.pack import PackSettings, pack_images
from hpctrain.data.images.throughput import loader_throughput
from hpctrain.data.order import BatchLayout
from hpctrain.data.samples import SampleLoader, batch_reader
from hpctrain.errors import DataError
from hpctrain.task import sample_rng


def _bytes(b: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8)


def _png(w: int = 20, h: int = 10) -> bytes:
    buf = io.BytesIO()
    Image.new("RGBA", (w, h), (10, 200, 30, 128)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def shards(image_tree, tmp_path_factory) -> ImageShards:
    src, _ = image_tree
    out = tmp_path_factory.mktemp("pipe") / "out"
    pack_images(src, out, PackSettings(shard_bytes=6000))
    return ImageShards(out)


def test_cpu_decode_skips_and_names_corrupt_images(caplog) -> None:
    good = tiny_jpeg(1)
    truncated = good[: len(good) // 2]
    garbage = b"\xff\xd8\xff" + bytes(200)
    batch = EncodedImages([_bytes(good), _bytes(truncated), _bytes(garbage), _bytes(_png())],
                          [("shard-000007.tar", f"k{i}", 100) for i in range(4)])
    stats = DecodeStats()
    with caplog.at_level(logging.WARNING, logger="hpctrain.data"):
        out = decode_batch(batch, "cpu", stats=stats)
    assert out.kept == [0, 3]
    assert out[0].dtype == torch.uint8 and out[0].shape == (3, 32, 32)
    want = torch.from_numpy(__import__("numpy").array(Image.open(io.BytesIO(good)).convert("RGB")))
    assert torch.equal(out[0], want.permute(2, 0, 1))
    assert out[1].shape == (3, 10, 20)  # PNG with alpha, through Pillow, as RGB
    assert (stats.decoded, stats.bad) == (2, 2)
    assert "'k1'" in caplog.text and "'k2'" in caplog.text and "shard-000007.tar" in caplog.text
    threaded = decode_batch(batch, "cpu", threads=2)  # Pillow on a thread pool: same result
    assert threaded.kept == out.kept
    assert all(torch.equal(a, b) for a, b in zip(threaded, out, strict=True))


def test_an_eps_file_named_jpg_never_reaches_a_non_raster_plugin(monkeypatch) -> None:
    # Pillow's EPS plugin runs Ghostscript on load: a shard from someone else must not get there.
    from PIL import EpsImagePlugin
    opened = []
    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", lambda self: opened.append(1))
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nshowpage\n"
    stats = DecodeStats()
    out = decode_batch(EncodedImages([_bytes(eps), _bytes(_png())],
                                     [("shard-000003.tar", f"x{i}.jpg", 100) for i in range(2)]),
                       "cpu", stats=stats)
    assert out.kept == [1] and (stats.decoded, stats.bad) == (1, 1)
    assert opened == []


def test_a_shard_of_only_bad_images_is_an_error() -> None:
    bad = _bytes(b"\xff\xd8\xff" + bytes(50))
    stats = DecodeStats()
    decode_batch(EncodedImages([bad], [("shard-000002.tar", "a", 2)]), "cpu", stats=stats)
    with pytest.raises(DataError, match="shard-000002.tar.*all 2 images"):
        decode_batch(EncodedImages([bad], [("shard-000002.tar", "b", 2)]), "cpu", stats=stats)


def test_reduced_size_decode_keeps_the_shorter_side() -> None:
    big = tiny_jpeg(3, size=(256, 192))
    full = decode_batch([_bytes(big)], "cpu")[0]
    small = decode_batch([_bytes(big)], "cpu", min_side=40)[0]
    assert full.shape == (3, 192, 256)
    assert small.shape[1] >= 40 and small.shape[1] < 192 // 2  # decoded at 1/4 scale


def test_crop_boxes_follow_random_resized_crop() -> None:
    g = torch.Generator().manual_seed(0)
    sizes = [(375, 500)] * 200 + [(10, 400)]  # the last one is too wide: the centre fallback
    boxes = crop_boxes(sizes, g)
    for (h_img, w_img), (t, left, h, w) in zip(sizes[:-1], boxes[:-1], strict=True):
        assert 0 <= t <= h_img - h and 0 <= left <= w_img - w
        assert 0.08 * 0.9 <= h * w / (h_img * w_img) <= 1.0
        assert 3 / 4 * 0.9 <= w / h <= 4 / 3 * 1.1
    assert boxes[-1] == (0, (400 - 13) // 2, 10, 13)
    assert len({b for b in boxes[:-1]}) > 150  # random, not a constant box


def _crop_boxes_image_by_image(sizes, g, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params, one image at a time, from the same draws
    (what crop_boxes computed before it took the batch at once)."""
    u = torch.rand((len(sizes), 10, 4), generator=g, dtype=torch.float64).tolist()
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    boxes = []
    for k, (height, width) in enumerate(sizes):
        for t in range(10):
            target = height * width * (scale[0] + (scale[1] - scale[0]) * u[k][t][0])
            aspect = math.exp(log_lo + (log_hi - log_lo) * u[k][t][1])
            w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < w <= width and 0 < h <= height:
                boxes.append((min(int(u[k][t][2] * (height - h + 1)), height - h),
                              min(int(u[k][t][3] * (width - w + 1)), width - w), h, w))
                break
        else:
            in_ratio = width / height
            w, h = ((width, round(width / min(ratio))) if in_ratio < min(ratio) else
                    (round(height * max(ratio)), height) if in_ratio > max(ratio) else
                    (width, height))
            boxes.append(((height - h) // 2, (width - w) // 2, h, w))
    return boxes


def test_crop_boxes_of_a_batch_equal_those_image_by_image() -> None:
    # The batch's tries at once (numpy) give the boxes of the per-image loop, bit for bit:
    # a resume, or another version, crops the same way. Tiny, thin and odd sizes included.
    rng = torch.Generator().manual_seed(1)
    sizes = [(int(h), int(w)) for h, w in torch.randint(1, 700, (3000, 2), generator=rng)]
    sizes += [(375, 500), (1, 1), (2, 900), (900, 2), (10, 400)]
    for scale, ratio in (((0.08, 1.0), (3 / 4, 4 / 3)), ((0.5, 1.0), (1.0, 1.0))):
        assert crop_boxes(sizes, torch.Generator().manual_seed(7), scale, ratio) == \
            _crop_boxes_image_by_image(sizes, torch.Generator().manual_seed(7), scale, ratio)


def test_pipeline_train_and_eval(shards) -> None:
    images, labels = collate_images([shards[i] for i in range(6)])
    pipe = ImagePipeline(16, train=True, dtype=torch.bfloat16)
    x, y = pipe(images, labels, augment_generator(1, 5, 0))
    assert x.shape == (6, 3, 16, 16) and x.dtype == torch.bfloat16
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(y, labels)
    x2, _ = pipe(images, labels, augment_generator(1, 5, 0))
    x3, _ = pipe(images, labels, augment_generator(1, 6, 0))
    assert torch.equal(x, x2) and not torch.equal(x, x3)  # a resume replays the same crops
    with pytest.raises(ValueError, match="explicit torch.Generator"):
        pipe(images, labels)

    ev = ImagePipeline(24, train=False, resize=28)
    x, y = ev(images, labels)
    assert x.shape == (6, 3, 24, 24) and x.dtype == torch.float32
    # Resize 32 -> 28 then the centre 24: torch's float resize and a slice, within one 8-bit
    # level (the CPU path resizes in uint8).
    img = decode_batch(images.data[:1], "cpu")[0][None].float()
    ref = torch.nn.functional.interpolate(img, size=(28, 28), mode="bilinear", antialias=True,
                                          align_corners=False)[..., 2:26, 2:26]
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255
    torch.testing.assert_close(x[:1], (ref - mean) / std, rtol=0, atol=1.01 / (255 * 0.224))


def test_labels_follow_a_skipped_image(shards) -> None:
    images, labels = collate_images([shards[i] for i in range(4)])
    images.data[1] = _bytes(b"\xff\xd8\xff" + bytes(40))
    images.sources[1] = ("shard-000009.tar", "bad", 100)  # one bad of many: skipped, no error
    x, y = ImagePipeline(8, train=False)(images, labels)
    assert x.shape[0] == 3 and torch.equal(y, labels[[0, 2, 3]])


def test_loader_order_equal_counts_and_exact_resume(shards) -> None:
    """Two ranks of SampleLoader over the shards: disjoint equal slices; a resumed loader
    continues with the same samples."""
    keys = {}
    for rank in (0, 1):
        loader = SampleLoader(shards, BatchLayout(2, 1, 2, rank), seed=3,
                              device=torch.device("cpu"), collate=collate_images, prefetch=0)
        keys[rank] = [[k for _, k, _ in loader.next_step()[0][0].sources] for _ in range(4)]
        resumed = SampleLoader(shards, BatchLayout(2, 1, 2, rank), seed=3,
                               device=torch.device("cpu"), collate=collate_images, prefetch=0)
        resumed.load_state_dict({**loader.state_dict(), "step": 2})
        assert [[k for _, k, _ in resumed.next_step()[0][0].sources]
                for _ in range(2)] == keys[rank][2:]
    assert all(len(b) == 2 for r in keys for b in keys[r])
    flat = [k for r in keys for b in keys[r] for k in b]
    assert len(flat) == len(set(flat)) == 16


def test_loader_throughput_reports_images_per_second(shards) -> None:
    r = loader_throughput(shards.root.parent, batch=4, steps=2, warmup=1, size=16, timed=True)
    assert r["images"] == 8 and r["images_per_s"] > 0 and r["skipped_images"] == 0
    assert r["decode_ms_per_image"] > 0 and r["augment_ms_per_image"] > 0
    r = loader_throughput(shards.root.parent, batch=4, steps=2, warmup=1, size=16, ahead=True)
    assert r["images"] == 8 and r["ahead"]


def test_decode_ahead_in_the_loader_thread_resumes_bit_identically(shards) -> None:
    pipe = ImagePipeline(16, train=True, dtype=torch.bfloat16)

    def loader(step: int) -> SampleLoader:
        ld = SampleLoader(shards, BatchLayout(3, 1, 1, 0), seed=5, device=torch.device("cpu"),
                          collate=DecodeAhead(pipe, seed=5), prefetch=2)
        ld.load_state_dict({**ld.state_dict(), "step": step})
        return ld

    first = loader(0)
    assert first.two_stage  # reading and decoding on two threads, in one order
    batches = [pipe(*first.next_step()[0]) for _ in range(3)]  # PreparedImages pass through
    first.close()
    assert all(x.shape == (3, 3, 16, 16) and x.dtype == torch.bfloat16 for x, _ in batches)
    resumed = loader(2)
    x, y = pipe(*resumed.next_step()[0])
    resumed.close()
    assert torch.equal(x, batches[2][0]) and torch.equal(y, batches[2][1])
    assert not torch.equal(batches[0][0], batches[1][0])


class _RecordedEvent:
    """What the timing reads of a CUDA event pair: ``elapsed_time`` in milliseconds."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, end: _RecordedEvent) -> float:
        return end.ms - self.ms


def test_decode_ahead_reports_milliseconds_per_image(shards) -> None:
    # CUDA events measure milliseconds already: 50 ms over 1000 images is 0.05 ms each (the
    # old conversion multiplied by 1e3 again and logged 50).
    assert event_ms_per_image(_RecordedEvent(0.0), _RecordedEvent(50.0), 1000) == 0.05
    assert wall_ms_per_image(1.0, 1.5, 100) == pytest.approx(5.0)
    # On the CPU both parts are wall time: together no longer than the whole call.
    samples = [shards[i] for i in range(4)]
    t0 = time.perf_counter()
    prepared, _ = DecodeAhead(ImagePipeline(16), seed=0)(samples)
    total_ms = (time.perf_counter() - t0) * 1e3
    assert 0 < (prepared.decode_ms + prepared.augment_ms) * 4 <= total_ms


def test_host_decoded_images_travel_packed_in_one_buffer() -> None:
    """Host-decoded images (Pillow's permuted HWC views among them) come back as (3, H, W)
    views of one buffer, pixel for pixel: on CUDA that buffer is the one pinned copy a batch
    makes (a pinned buffer per image made the decode split 17x slower on an H200 host)."""
    from hpctrain.data.images.decode import to_device_packed

    g = torch.Generator().manual_seed(0)
    hwc = torch.randint(0, 256, (5, 7, 3), dtype=torch.uint8, generator=g)
    images = [torch.randint(0, 256, (3, 4, 6), dtype=torch.uint8, generator=g),
              hwc.permute(2, 0, 1), torch.randint(0, 256, (3, 1, 1), dtype=torch.uint8,
                                                   generator=g)]
    out = to_device_packed(images, torch.device("cpu"), pin=False)
    assert [o.shape for o in out] == [i.shape for i in images]
    assert all(torch.equal(o, i) for o, i in zip(out, images, strict=True))
    assert all(o.is_contiguous() for o in out)
    base = out[0].untyped_storage().data_ptr()
    assert all(o.untyped_storage().data_ptr() == base for o in out)  # one buffer
    assert to_device_packed([], torch.device("cpu")) == []


class _Relabelled(ImageShards):
    """A user's subclass that relabels in ``__getitem__`` (and draws from ``sample_rng()``)."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        data, label = super().__getitem__(i)
        torch.rand(1, generator=sample_rng())  # outside reading_sample this raises
        return data, 100 + label


def test_a_subclass_that_overrides_getitem_is_read_through_it(shards) -> None:
    # read_samples reads what ImageShards.__getitem__ would: a subclass's own __getitem__
    # (and its seeding) must not be bypassed by it.
    relabelled = _Relabelled(shards.root.parent)
    try:
        loader = SampleLoader(relabelled, BatchLayout(4, 1, 1, 0), seed=3,
                              device=torch.device("cpu"), collate=collate_images, prefetch=0)
        _, labels = loader.next_step()[0]
        assert all(label >= 100 for label in labels.tolist())
        assert batch_reader(shards) is not None and batch_reader(relabelled) is None
    finally:
        relabelled.close()


class _QueriedTogether(_RecordedEvent):
    """An end event whose ``query`` returns once two threads are in it (or 0.3 s passed)."""

    def __init__(self, ms: float, barrier: threading.Barrier) -> None:
        super().__init__(ms)
        self.barrier = barrier

    def query(self) -> bool:
        with contextlib.suppress(threading.BrokenBarrierError):
            self.barrier.wait(timeout=0.3)
        return True


def test_two_threads_sharing_decode_ahead_pop_each_timing_once() -> None:
    # The training loader's thread and validation's read-ahead thread share one DecodeAhead:
    # both saw the finished timing, both popped it, one on an empty deque (IndexError).
    ahead = DecodeAhead(ImagePipeline(8), seed=0)
    ahead._timings.append((_RecordedEvent(0.0), _QueriedTogether(8.0, threading.Barrier(2)), 4,
                           []))
    with ThreadPoolExecutor(2) as pool:
        got = [f.result() for f in [pool.submit(ahead._done_augment_ms) for _ in range(2)]]
    assert sorted(got, key=lambda ms: ms is None) == [2.0, None]


class _Pending(_RecordedEvent):
    """An end event the device has or has not reached yet."""

    def __init__(self, ms: float, done: bool) -> None:
        super().__init__(ms)
        self.done = done

    def query(self) -> bool:
        return self.done


def test_decoded_images_are_kept_until_the_crops_that_read_them_have_run() -> None:
    # On CUDA a batch's decoded images are freed only once its crops' end event has completed
    # (their blocks would otherwise go back to the decode stream while the crops still read
    # them), without record_stream per image: each was a GIL release and re-take.
    ahead = DecodeAhead(ImagePipeline(8), seed=0)
    images = [torch.zeros(3, 4, 4, dtype=torch.uint8)]
    alive = weakref.ref(images[0])
    end = _Pending(4.0, done=False)
    ahead._timings.append((_RecordedEvent(0.0), end, 2, images))
    del images
    assert ahead._done_augment_ms() is None and alive() is not None  # crops still queued
    end.done = True
    assert ahead._done_augment_ms() == 2.0 and alive() is None


def test_a_batch_that_lost_images_is_padded_with_the_kept_ones_in_turn(shards) -> None:
    images, labels = collate_images([shards[i] for i in range(5)])
    for bad in (1, 3):
        images.data[bad] = _bytes(b"\xff\xd8\xff" + bytes(40))
        images.sources[bad] = ("shard-000009.tar", f"bad{bad}", 100)
    prepared, kept = DecodeAhead(ImagePipeline(8), seed=0).prepare(images, labels)
    x = prepared.tensor
    assert x.shape[0] == 5 and torch.equal(kept, labels[[0, 2, 4]])
    # The kept rows 0..2, then rows 0 and 1 again (not row 0 twice: BatchNorm would lean on it).
    assert torch.equal(x[3], x[0]) and torch.equal(x[4], x[1]) and not torch.equal(x[4], x[0])


def test_packing_checks_its_images_and_leaves_cpu_images_alone() -> None:
    from hpctrain.data.images.decode import to_device_packed

    images = [torch.zeros((3, 2, 2), dtype=torch.uint8), torch.ones((3, 1, 4), dtype=torch.uint8)]
    out = to_device_packed(images, torch.device("cpu"))  # pin=None on the CPU: no packing
    assert all(o is i for o, i in zip(out, images, strict=True))
    for wrong in (torch.zeros((3, 2, 2)), torch.zeros((2, 2), dtype=torch.uint8)):
        with pytest.raises(DataError, match=r"uint8 \(3, H, W\)"):
            to_device_packed([images[0], wrong], torch.device("cpu"), pin=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the lead's run)")
def test_host_decoded_images_reach_the_gpu_through_one_pinned_buffer() -> None:
    from hpctrain.data.images.decode import to_device_packed

    g = torch.Generator().manual_seed(0)
    hwc = torch.randint(0, 256, (5, 7, 3), dtype=torch.uint8, generator=g)
    images = [torch.randint(0, 256, (3, 4, 6), dtype=torch.uint8, generator=g),
              hwc.permute(2, 0, 1)]
    out = to_device_packed(images, torch.device("cuda"))
    torch.cuda.synchronize()
    assert all(o.is_cuda for o in out)
    assert all(torch.equal(o.cpu(), i) for o, i in zip(out, images, strict=True))
    assert len({o.untyped_storage().data_ptr() for o in out}) == 1  # one copy of one buffer


def test_loader_throughput_counts_the_images_kept_not_the_padding(tmp_path) -> None:
    # Ahead, a batch that lost an image is padded to its size: images/s counts the kept ones.
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    for j in range(4):
        (src / "a" / f"img{j}.jpg").write_bytes(tiny_jpeg(j))
    (src / "a" / "img4.jpg").write_bytes(b"\xff\xd8\xff" + bytes(40))
    pack_images(src, tmp_path / "out", PackSettings())
    r = loader_throughput(tmp_path / "out", batch=5, steps=1, warmup=1, size=8, ahead=True)
    assert r["images"] == 4 and r["skipped_images"] >= 2  # and in the batches read ahead


def test_packing_a_batch_is_one_op() -> None:
    # Pillow's threads make the images (3, H, W)-contiguous on the CUDA path: the loader
    # thread then packs the whole batch in one cat (it copied image by image: an op each).
    from test_crop_kernel import _CountOps

    from hpctrain.data.images.decode import _cpu_or_none, to_device_packed

    images = [_cpu_or_none(_bytes(tiny_jpeg(i, (8 + i, 6))), None, contiguous=True)[0]
              for i in range(6)]
    assert all(img.is_contiguous() and img.shape == (3, 6, 8 + i) for i, img in
               enumerate(images))
    with _CountOps() as mode:
        out = to_device_packed(images, torch.device("cpu"), pin=False)
    copies = {op: k for op, k in mode.ops.items() if "view" not in op and "split" not in op}
    assert copies == {"aten.empty.memory_format": 1, "aten.cat.out": 1}, copies
    assert all(torch.equal(o, i) for o, i in zip(out, images, strict=True))
