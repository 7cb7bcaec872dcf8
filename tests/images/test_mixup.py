"""Mixup/CutMix (task_args.mixup): drawn from the batch's sample keys (the same after a resume),
applied to the images on their device, the loss mixing the labels with the same weight, top-1
counted on the images' own labels; off by default and in evaluation."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.data.images import DecodeAhead, ImagePipeline, batch_generator
from hpctrain.data.images.mix import Mixing
from hpctrain.data.images.reader import ImageSample
from hpctrain.errors import ConfigError
from hpctrain.tasks.images import ImageClassifier, ImageTaskConfig

Image = pytest.importorskip("PIL.Image")

SOURCES = [("shard-000000.tar", f"k{i}", 8) for i in range(8)]


def _images(seed: int = 0) -> torch.Tensor:
    return torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(seed)).contiguous(
        memory_format=torch.channels_last)


def test_mixup_blends_each_image_with_its_mirror_by_a_weight_drawn_from_the_keys() -> None:
    x = _images()
    mixed, lam = Mixing("mixup")(x, batch_generator(0, SOURCES))
    assert 0 < lam < 1
    torch.testing.assert_close(mixed, lam * x + (1 - lam) * x.flip(0))
    again, same = Mixing("mixup")(x, batch_generator(0, SOURCES))  # a resumed run's draw
    assert same == lam and torch.equal(again, mixed)
    other = Mixing("mixup")(x, batch_generator(0, SOURCES[::-1]))[1]
    assert other != lam  # other samples, another weight


def test_cutmix_pastes_a_box_whose_area_sets_the_weight() -> None:
    x = _images()
    mixed, lam = Mixing("cutmix")(x, batch_generator(1, SOURCES))
    pasted = (mixed == x.flip(0)) & (mixed != x)
    assert pasted.any()
    assert pasted.float().mean().item() == pytest.approx(1 - lam)
    assert {Mixing("both")(x, batch_generator(s, SOURCES))[0].equal(
        Mixing("both")(x, batch_generator(s, SOURCES))[0]) for s in range(4)} == {True}


def _jpeg(value: int) -> ImageSample:
    buf = io.BytesIO()
    Image.new("RGB", (20, 18), (value, 255 - value, value // 2)).save(buf, "JPEG")
    return ImageSample(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8),
                       value % 4, "shard-000000.tar", f"img{value}", 8)


def test_the_step_mixes_the_labels_and_counts_hits_on_its_own() -> None:
    cfg = ImageTaskConfig(data="unused", image_size=16, mixup="mixup", label_smoothing=0.1)
    parts = ImageClassifier(cfg, 4, build=lambda classes, size: nn.Sequential(
        nn.Flatten(), nn.Linear(3 * size * size, classes)))
    model = parts.model()
    samples = [_jpeg(v) for v in range(0, 240, 30)]
    prepared, labels = parts.collate(samples)
    assert prepared.lam is not None and prepared.tensor.is_contiguous(
        memory_format=torch.channels_last)
    loss, metrics = parts.step(model, (prepared, labels))
    logits = model(prepared.tensor)
    lam = prepared.lam
    assert loss.item() == pytest.approx(
        lam * F.cross_entropy(logits, labels, label_smoothing=0.1).item()
        + (1 - lam) * F.cross_entropy(logits, labels.flip(0), label_smoothing=0.1).item(),
        rel=1e-5)
    hits = (logits.argmax(-1) == labels).float()
    torch.testing.assert_close(metrics["top1"], hits)
    # The same batch without mixing: other pixels; evaluation never mixes.
    plain = DecodeAhead(ImagePipeline(16, flip=True), cfg.augment_seed)(samples)[0]
    assert plain.lam is None and not torch.equal(plain.tensor, prepared.tensor)
    assert parts.eval_collate(samples)[0].lam is None


def test_a_bad_mixup_setting_names_the_key() -> None:
    with pytest.raises(ConfigError, match="mixup_alpha"):
        ImageTaskConfig(data="x", mixup="mixup", mixup_alpha=0).validate()
