"""A step whose micro-batches lost samples (an image that does not decode is skipped) trains on
the mean over the samples it kept, each weighing the same, not on the mean of its micro-batch
means (which would weigh a sample of a short micro-batch more)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain import fit
from hpctrain.task import Task

# Eight samples, targets all different; three are "corrupt": whichever micro-batches of 4 they
# fall in, the two micro-batches keep different counts (5 kept in all: 1+4 or 2+3).
TARGETS = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0])
BAD = {0, 3, 6}


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return len(TARGETS)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, TARGETS[i]


def drop_bad(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Like the image task's collate: the samples that 'decode', the rest skipped."""
    ys = [y for i, y in samples if i not in BAD]
    return torch.ones(len(ys), 1), torch.tensor(ys).view(-1, 1)


def zero_model() -> nn.Module:
    model = nn.Linear(1, 1, bias=False)
    nn.init.zeros_(model.weight)  # the first loss is the mean of y**2 over the kept samples
    return model


def _first_step(task: Task, tmp_path: Path) -> dict:
    """The metrics record of step 1 of ``task`` (one step of two micro-batches of 4)."""
    fit(task, overrides={"run.out_dir": str(tmp_path), "run.name": "dropped",
                         "run.device": "cpu", "train.steps": 1, "train.micro_batch": 4,
                         "train.grad_accum": 2, "train.precision": "fp32",
                         "optim.name": "sgd", "optim.lr": 0.1, "optim.momentum": 0.0,
                         "optim.weight_decay": 0.0, "optim.warmup_steps": 0,
                         "train.grad_clip": 0.0, "checkpoint.interval": "none",
                         "checkpoint.save_at_end": False, "metrics.progress": False,
                         "metrics.log_every": 1})
    records = [json.loads(line) for line in
               (tmp_path / "dropped" / "metrics" / "rank-000.jsonl").read_text().splitlines()]
    (step,) = [r for r in records if r.get("step") == 1 and "loss" in r]
    return step


def test_a_steps_loss_is_the_mean_over_the_samples_kept(tmp_path: Path) -> None:
    task = Task(model=zero_model, data=Samples(), loss=nn.functional.mse_loss,
                collate=drop_bad, flops_per_sample=1.0,
                samples_in_batch=lambda batch: len(batch[1]))
    step = _first_step(task, tmp_path)
    kept = [y for i, y in enumerate(TARGETS.tolist()) if i not in BAD]
    assert step["loss"] == pytest.approx(sum(y * y for y in kept) / len(kept), rel=1e-6)


def test_a_micro_batch_that_lost_every_sample_adds_nothing(tmp_path: Path) -> None:
    """A generic task (not the image task's own guard): the empty micro-batch's loss, a mean
    over nothing, is NaN (before: NaN x weight 0 = NaN, the first-step check refused it), and
    its empty per-sample metric adds nothing; the other's count once per sample."""
    kept: list[list[float]] = []

    def drop_the_batch_of_sample_0(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
        ys = [] if any(i == 0 for i, _ in samples) else [float(y) for _, y in samples]
        kept.append(ys)
        return torch.ones(len(ys), 1), torch.tensor(ys).view(-1, 1)

    def step(model: nn.Module, batch: tuple) -> tuple[torch.Tensor, dict]:
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        return loss, {"big": (y.view(-1) > 4).float(), "one": torch.ones(())}

    task = Task(model=zero_model, data=Samples(), step=step, flops_per_sample=1.0,
                collate=drop_the_batch_of_sample_0,
                samples_in_batch=lambda batch: len(batch[1]))
    step_record = _first_step(task, tmp_path)
    ys = [y for batch in kept[:2] for y in batch]  # the first two collates: step 1's
    assert len(ys) == 4 and [] in kept[:2]
    assert step_record["loss"] == pytest.approx(sum(y * y for y in ys) / 4, rel=1e-6)
    assert step_record["big"] == pytest.approx(sum(y > 4 for y in ys) / 4)
    assert step_record["one"] == 1.0


def test_an_image_batch_that_lost_an_image_keeps_its_shape_and_counts_the_rest() -> None:
    """The image task pads a batch that lost an image back to its size (a compiled model sees
    one shape: no recompile), with a copy of a kept image; its loss and metrics are those of
    the kept images alone."""
    import io

    from PIL import Image

    from hpctrain.data.images.reader import ImageSample
    from hpctrain.tasks.images import ImageClassifier, ImageTaskConfig

    def sample(value: int, data: bytes | None = None) -> ImageSample:
        if data is None:
            buf = io.BytesIO()
            Image.new("RGB", (20, 18), (value, 255 - value, value // 2)).save(buf, "JPEG")
            data = buf.getvalue()
        return ImageSample(torch.frombuffer(bytearray(data), dtype=torch.uint8), value % 4,
                           "shard-000000.tar", f"img{value}", 100)

    parts = ImageClassifier(ImageTaskConfig(data="unused", image_size=16), 4,
                            build=lambda classes, size: nn.Sequential(
                                nn.Flatten(), nn.Linear(3 * size * size, classes)))
    samples = [sample(v) for v in (1, 62, 123, 184)]
    samples[1] = sample(62, b"\xff\xd8\xff" + bytes(40))  # does not decode: skipped
    prepared, labels = parts.collate(samples)
    assert prepared.tensor.shape[0] == 4 and labels.tolist() == [1, 3, 0]
    assert torch.equal(prepared.tensor[3], prepared.tensor[0])
    model = parts.model()
    loss, metrics = parts.step(model, (prepared, labels))
    kept = prepared.tensor[:3]
    want = nn.functional.cross_entropy(model(kept), labels, label_smoothing=0.1)
    torch.testing.assert_close(loss, want)
    assert metrics["top1"].shape == (3,)
