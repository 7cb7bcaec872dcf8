"""The image task decodes on the device its model was built on, whatever collated first."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

from hpctrain.data.images.reader import ImageSample
from hpctrain.task import TaskError
from hpctrain.tasks.images import ImageClassifier, ImageTaskConfig

Image = pytest.importorskip("PIL.Image")


def _jpeg(value: int) -> ImageSample:
    buf = io.BytesIO()
    Image.new("RGB", (20, 18), (value, 255 - value, value // 2)).save(buf, "JPEG")
    return ImageSample(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8),
                       value % 4, "shard-000000.tar", f"img{value}", 8)


def test_a_batch_collated_before_the_model_pins_no_device() -> None:
    """A plan or a notebook may collate before the trainer builds the model on its device: the
    pipelines are per device (before: the first collate's CPU pipeline for good), and a batch
    on another device than the model's is refused by name, not by a kernel's error."""
    parts = ImageClassifier(ImageTaskConfig(data="unused", image_size=16), 4,
                            build=lambda classes, size: nn.Sequential(
                                nn.Flatten(), nn.Linear(3 * size * size, classes)))
    samples = [_jpeg(v) for v in (0, 60, 120)]
    early, labels = parts.collate(samples)  # no model yet: the CPU
    assert early.tensor.device.type == "cpu"
    # The trainer's device stands in by the meta device here (a CPU machine has no second):
    # what model() records when the factory is called under a GPU.
    parts.device = torch.device("meta")
    assert parts._decoder(True).pipeline.device.type == "meta"
    assert parts._decoder(True, torch.device("cpu")).pipeline.device.type == "cpu"
    with torch.device("meta"):
        on_meta = parts.build(4, 16)
    with pytest.raises(TaskError, match="on cpu, the model on meta") as info:
        parts.step(on_meta, (early, labels))
    assert info.value.hint
    loss, _ = parts.step(parts.model(), (early, labels))  # built on the CPU: the batch's
    assert loss.isfinite()


def test_gil_switch_ms_sets_the_processs_switch_interval(monkeypatch) -> None:
    """task_args.gil_switch_ms: how long a thread waiting for the GIL (the training thread
    launching kernels, or a loader thread) waits at most; unset leaves Python's default."""
    import sys

    from hpctrain.errors import ConfigError

    monkeypatch.setattr(sys, "setswitchinterval", lambda s: calls.append(s))
    calls: list[float] = []
    ImageClassifier(ImageTaskConfig(data="unused"), 4)
    assert calls == []
    ImageClassifier(ImageTaskConfig(data="unused", gil_switch_ms=0.5), 4)
    assert calls == [0.0005]
    with pytest.raises(ConfigError, match="gil_switch_ms = -1"):
        ImageTaskConfig(data="x", gil_switch_ms=-1).validate()


def test_cuda_graphs_has_inductor_replay_the_compiled_model_as_graphs(monkeypatch) -> None:
    """task_args.cuda_graphs: inductor's CUDA graphs (torch.compile's reduce-overhead) for the
    rank's process; unset leaves inductor as it is."""
    import torch._inductor.config as inductor

    monkeypatch.setattr(inductor.triton, "cudagraphs", False)
    ImageClassifier(ImageTaskConfig(data="unused"), 4)
    assert inductor.triton.cudagraphs is False
    ImageClassifier(ImageTaskConfig(data="unused", cuda_graphs=True), 4)
    assert inductor.triton.cudagraphs is True
