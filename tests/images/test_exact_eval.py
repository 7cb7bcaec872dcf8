"""Exact distributed evaluation: every sample once, top-1/top-5 on 2 ranks == one process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from conftest import spawn_ranks
from hpctrain.errors import HpctrainError
from hpctrain.observe.accuracy import topk_correct
from hpctrain.train.exact_eval import ExactSums, ValidationSampler, rank_batches

SAMPLES, CLASSES, MICRO = 23, 12, 4  # 23 on 2 ranks of 4: an uneven, padded tail


def _evaluate(rank: int, world: int) -> tuple[dict[str, float], int]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 16, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    torch.manual_seed(1)
    model = torch.nn.Linear(16, CLASSES)
    with torch.no_grad():  # every third label is the model's guess: top-1 is neither 0 nor 1
        y[::3] = model(x[::3]).argmax(1)
    sums = ExactSums(torch.device("cpu"))
    with torch.no_grad():
        for indices, n in rank_batches(ValidationSampler(SAMPLES, world, rank, MICRO)):
            ix = torch.from_numpy(indices)
            logits = model(x[ix])
            sums.add({"loss": F.cross_entropy(logits, y[ix]), **topk_correct(logits, y[ix]),
                      # which samples were counted: each exactly once makes these sums exact
                      "index": ix.double(), "index_sq": ix.double() ** 2}, n)
    return sums.reduce()


def _rank(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        queue.put((rank, _evaluate(rank, 2)))
    finally:
        dist.destroy_process_group()


def test_two_ranks_equal_one_process_on_an_odd_split() -> None:
    (one, count) = _evaluate(0, 1)
    assert count == SAMPLES
    assert one["index"] * SAMPLES == sum(range(SAMPLES))
    assert one["index_sq"] * SAMPLES == sum(i * i for i in range(SAMPLES))
    assert 0 < one["top1"] < one["top5"] < 1  # the metrics are not trivially 0 or 1
    results = spawn_ranks(_rank, 2)
    for _, (means, n) in results:
        assert n == SAMPLES
        for name in ("top1", "top5", "index", "index_sq"):
            assert means[name] == one[name], name  # sums of 0/1 hits: bit-identical
        # A float32 batch mean (as a Task's loss is): rounded differently in other batches.
        assert means["loss"] == pytest.approx(one["loss"], rel=1e-6)


@pytest.mark.parametrize("world", [1, 2, 3, 5, 30])
def test_every_sample_counted_once_in_equal_batch_counts(world: int) -> None:
    counted: list[int] = []
    batches = set()
    for rank in range(world):
        mine = list(rank_batches(ValidationSampler(SAMPLES, world, rank, MICRO)))
        batches.add(len(mine))
        for indices, n in mine:
            assert len(indices) >= 1  # a padding-only batch still runs one forward
            counted += indices[:n].tolist() if n else []
    assert sorted(counted) == list(range(SAMPLES))
    assert len(batches) == 1  # the same number of forwards (and collectives) on every rank


def test_topk_caps_k_at_the_class_count() -> None:
    logits = torch.tensor([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1]])
    hits = topk_correct(logits, torch.tensor([1, 2]))
    assert hits["top1"].tolist() == [1.0, 0.0]
    assert hits["top5"].tolist() == [1.0, 1.0]


def test_the_image_task_imports_nothing_from_the_trainer() -> None:
    """The trainer loads tasks: a task module reaching into train's internals (it took
    topk_correct from train.exact_eval) makes the dependency go both ways."""
    import ast

    import hpctrain.tasks.images as task_module

    tree = ast.parse(Path(task_module.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in imported if m and m.startswith("hpctrain.train")}, imported


def test_per_sample_values_of_the_wrong_shape_are_refused() -> None:
    sums = ExactSums(torch.device("cpu"))
    with pytest.raises(HpctrainError, match="shape"):
        sums.add({"top1": torch.ones(5)}, 4)
    sums.add({"top1": torch.ones(4)}, 4)
    with pytest.raises(HpctrainError, match="differ"):
        sums.add({"top5": torch.ones(4)}, 4)


def test_a_batch_mean_is_weighted_by_the_samples_the_step_kept() -> None:
    sums = ExactSums(torch.device("cpu"))
    sums.add({"loss": torch.tensor(2.0), "top1": torch.ones(2)}, 4)  # 2 images did not decode
    sums.add({"loss": torch.tensor(1.0), "top1": torch.ones(4)}, 4)
    sums.add({"loss": torch.tensor(float("nan")), "top1": torch.ones(0)}, 4)  # none decoded
    means, count = sums.reduce()
    assert count == 12
    assert means["loss"] == pytest.approx((2 * 2 + 1 * 4) / 6)  # a mean over the kept images
    assert means["top1"] == 6 / 12  # an image that did not decode is a miss


@pytest.mark.parametrize("model", ["resnet_tiny", "vit_tiny"])
def test_a_micro_batch_whose_images_all_failed_gives_a_zero_loss_with_gradients(model) -> None:
    from hpctrain.data.images import PreparedImages
    from hpctrain.tasks.images import ImageClassifier, ImageTaskConfig

    parts = ImageClassifier(ImageTaskConfig(data="x", model=model, image_size=16,
                                            channels_last=False), num_classes=3)
    net = parts.model()
    empty = (PreparedImages(torch.zeros(0, 3, 16, 16)), torch.zeros(0, dtype=torch.int64))
    loss, metrics = parts.step(net, empty)
    assert loss.item() == 0 and metrics["top1"].shape == (0,)
    loss.backward()  # tied to the graph: every parameter the forward used gets a (zero) grad
    assert all(p.grad is None or not p.grad.any() for p in net.parameters())
    assert all(torch.isfinite(b).all() for b in net.buffers())  # BatchNorm's stats stay sane
