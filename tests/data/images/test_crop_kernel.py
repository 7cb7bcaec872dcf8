"""The batched crop kernel (what CUDA runs) tested on the CPU: the same pixels as the per-image
``F.interpolate(antialias=True)``, flips mirrored exactly, the same seeded boxes, and a number of
torch ops that does not grow with the batch."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hpctrain.data.images import (
    DecodeAhead,
    EncodedImages,
    ImagePipeline,
    augment_generator,
    crop_boxes,
)
from hpctrain.data.images.crop_kernel import (
    batch_crops,
    centre_geometry,
    groups_by_size,
    train_geometry,
)
from hpctrain.data.images.decode import Decoded

S = 24


def _images(n: int, seed: int = 0) -> list[torch.Tensor]:
    """Random uint8 images of mixed sizes, some smaller than S (upscaled), some much larger."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(12, 80, (n, 2), generator=g).tolist()
    return [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g) for h, w in sizes]


def _resize(img: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    return F.interpolate(img[None].float(), size=size, mode="bilinear", antialias=True,
                         align_corners=False)[0]


def test_batched_crops_equal_the_per_image_antialiased_resize() -> None:
    images = _images(10)
    sizes = [tuple(img.shape[-2:]) for img in images]
    boxes = crop_boxes(sizes, torch.Generator().manual_seed(3))
    flips = [k % 3 == 0 for k in range(len(images))]
    x = batch_crops(images, [train_geometry(hw, b, S, f)
                             for hw, b, f in zip(sizes, boxes, flips, strict=True)], S)
    ref = torch.stack([_resize(img[:, t:t + h, lf:lf + w], (S, S)) for img, (t, lf, h, w)
                       in zip(images, boxes, strict=True)])
    ref[flips] = ref[flips].flip(-1)
    # The same weights as PyTorch's antialiased kernel, summed in another order: float32
    # rounding only (~1e-5 of 255 levels), on noise, where any other filter differs by levels.
    assert (x - ref).abs().max() < 1e-3
    half = batch_crops(images, [train_geometry(hw, b, S, f) for hw, b, f
                                in zip(sizes, boxes, flips, strict=True)], S, torch.float16)
    # float16 (CUDA's): uint8 levels are exact; its 11-bit weights and the intermediate's
    # 1/8-level spacing at 128..255 keep every pixel within half a level.
    assert (half.float() - ref).abs().max() < 0.5

    unflipped = batch_crops(images, [train_geometry(hw, b, S, False)
                                     for hw, b in zip(sizes, boxes, strict=True)], S)
    assert torch.equal(x[flips], unflipped[flips].flip(-1))  # mirrored weights: bit-exact
    assert torch.equal(x[[not f for f in flips]], unflipped[[not f for f in flips]])

    # A batch too large to pad to its largest box in one go is cropped in groups of similar
    # sizes (the largest alone here), and comes back in batch order.
    geometry = [train_geometry(hw, b, S, f) for hw, b, f in zip(sizes, boxes, flips, strict=True)]
    budget = 3 * max(g[4] * g[5] for g in geometry)  # room for the largest box only
    groups = groups_by_size(geometry, S, budget)
    assert len(groups) > 2 and sorted(k for g in groups for k in g) == list(range(len(images)))
    largest = max(range(len(images)), key=lambda k: geometry[k][4] * geometry[k][5])
    assert groups[-1] == [largest]
    assert (batch_crops(images, geometry, S, max_elements=budget) - ref).abs().max() < 1e-3

    resize = 28  # torchvision's Resize(28) + CenterCrop(24), image by image
    centre = batch_crops(images, [centre_geometry(hw, resize, S) for hw in sizes], S)
    for img, got in zip(images, centre, strict=True):
        h, w = img.shape[-2:]
        nh, nw = (resize, int(resize * w / h)) if h <= w else (int(resize * h / w), resize)
        top, left = round((nh - S) / 2), round((nw - S) / 2)
        want = _resize(img, (nh, nw))[:, top:top + S, left:left + S]
        assert (got - want).abs().max() < 1e-3


def test_batched_pipeline_crops_the_same_seeded_boxes_as_the_per_image_one() -> None:
    # Same generator, same boxes and flips: the two paths differ only by the CPU path's
    # rounding to whole uint8 levels (<= 1 level, i.e. 1 / (255 std) after normalising).
    images = Decoded(_images(6, seed=1), list(range(6)))
    for train in (True, False):
        fast, slow = (ImagePipeline(S, train=train, batched=b) for b in (True, False))
        x, kept = fast.augment(images, augment_generator(1, 5, 0))
        y, _ = slow.augment(images, augment_generator(1, 5, 0))
        assert kept == images.kept and x.is_contiguous(memory_format=torch.channels_last)
        assert (x - y).abs().max() <= 1.01 / (255 * 0.224)


def test_the_group_budget_counts_the_weights_of_small_boxes_resized_up() -> None:
    # 16 x 16 boxes resized to 224: each crop is 768 elements, its weights (224 x 16, twice,
    # float32 then float16) and resized rows (224 x 3 x 16, float16) ~28 times that. A budget
    # of 2x the crops alone held all 64 in one group, its temporaries ~15x the budget.
    geometry = [train_geometry((32, 32), (0, 0, 16, 16), 224, False)] * 64
    crops = 64 * 3 * 16 * 16
    groups = groups_by_size(geometry, 224, 2 * crops)
    assert len(groups) == 16 and sorted(k for g in groups for k in g) == list(range(64))
    assert groups_by_size(geometry, 224, 64 * (crops // 64 + 4 * 224 * 16 + 2 * 224 * 16)) == [
        list(range(64))]  # exactly the count: one group


class _CountOps(TorchDispatchMode):
    """Counts the ATen ops dispatched under it (each a kernel launch or a view)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_the_batched_pipeline_dispatches_as_many_ops_for_32_images_as_for_4() -> None:
    # What makes it fast on the GPU: launches per batch, not per image.
    for train in (True, False):
        pipe = ImagePipeline(S, train=train, batched=True)
        counts = []
        for n in (4, 32):
            images = Decoded(_images(n), list(range(n)))
            with _CountOps() as mode:
                pipe.augment(images, augment_generator(0, 0, 0))
            counts.append(mode.ops)
        assert counts[0] == counts[1], (train, counts)
        assert sum(counts[0].values()) < 150  # ~120, views included: ~1024 image by image


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the lead's run)")


# ~0.5 s of a GPU's clock: a side stream is still asleep while the host queues the rest.
_SLEEP_CYCLES = 10**9


def _jpegs(first: int) -> EncodedImages:
    """8 JPEGs of fixed sizes whose pixels depend on ``first`` (the same crops for any)."""
    from hpctrain.data.images.synthetic import synthetic_jpeg

    return EncodedImages([torch.frombuffer(bytearray(synthetic_jpeg(first + i, 1, (60 + i,
                                                                                 40 + 2 * i))),
                                           dtype=torch.uint8) for i in range(8)])


@cuda
def test_on_cuda_float16_crops_match_the_cpu() -> None:
    images = _images(12)
    sizes = [tuple(img.shape[-2:]) for img in images]
    geometry = [train_geometry(hw, b, S, k % 2 == 0) for k, (hw, b) in
                enumerate(zip(sizes, crop_boxes(sizes, torch.Generator().manual_seed(0)),
                              strict=True))]
    on_gpu = [img.cuda() for img in images]
    # Pillow's layout (HWC memory, a permuted view), as a host decode on CUDA may bring.
    on_gpu[1] = images[1].permute(1, 2, 0).contiguous().permute(2, 0, 1).cuda()
    on_gpu = batch_crops(on_gpu, geometry, S, torch.float16)
    assert (on_gpu.float().cpu() - batch_crops(images, geometry, S)).abs().max() < 0.5


@cuda
def test_batches_made_on_sleeping_side_streams_are_handed_over_intact() -> None:
    """Batches a then b (same sizes, other pixels) prepared while the crops' stream sleeps,
    compared at once with a serial prepare: the step's stream must wait for a's event, and b's
    nvJPEG outputs (written on torchvision's own stream, which waits for none of ours) must not
    take the blocks of a's images while a's crops are still queued."""
    a, b = _jpegs(0), _jpegs(100)
    pipe = ImagePipeline(S, train=True, device="cuda", dtype=torch.bfloat16)
    serial = [DecodeAhead(pipe, 3, side_stream=False).prepare(x, torch.arange(8))[0].tensor
              for x in (a, b)]
    ahead = DecodeAhead(pipe, 3)
    for x in (a, b):  # the streams' memory pools warmed up: no cudaMalloc while they sleep
        ahead.prepare(x, torch.arange(8))
    torch.cuda.synchronize()
    with torch.cuda.stream(ahead.cuda_streams()[1]):
        torch.cuda._sleep(_SLEEP_CYCLES)
    prepared = [ahead.prepare(x, torch.arange(8))[0] for x in (a, b)]
    assert all(p.ready is not None for p in prepared)  # the loader thread did not wait
    assert not prepared[0].ready.query()  # still asleep: the comparison below is a real test
    # Side stream or not, the same crops (cuBLAS may pick another workspace per stream: to
    # within a bf16 step, not bit for bit).
    for p, want in zip(prepared, serial, strict=True):
        torch.testing.assert_close(p.use().float(), want.float(), rtol=0, atol=0.05)


@cuda
def test_the_side_streams_start_after_what_the_default_stream_queued() -> None:
    # The pipeline's constants (normalisation) are computed on the default stream when it is
    # built: a side stream that did not wait for it could read them before they exist.
    pipe = ImagePipeline(S, device="cuda")
    t = torch.zeros(1 << 16, device=pipe.device)
    torch.cuda._sleep(_SLEEP_CYCLES)
    t.fill_(7)  # queued behind the sleep
    seen = []
    for stream in DecodeAhead(pipe, 0).cuda_streams():
        with torch.cuda.stream(stream):
            seen.append(t.clone())
    torch.cuda.synchronize()
    assert all(bool((x == 7).all()) for x in seen)
