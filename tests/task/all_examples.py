"""The shipped examples trained together as one task, so that one launch trains all of them.

    hpctrain train tests/task/all_examples.py --nproc 2 parallel.strategy=fsdp train.steps=6

Sample ``i`` is every example's sample ``i``; the model holds every example's model; the step
runs each example's own step (or loss) on its part and returns their sum, logging each
example's loss (``<example>_loss``), its metrics, and ``bn_stats``: the sum of the image
classifier's BatchNorm running statistics at the step's start (the ranks must agree on it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import image_classifier  # noqa: E402
import mlp_parquet  # noqa: E402
import tiny_transformer  # noqa: E402

from hpctrain.task import Task  # noqa: E402

EXAMPLES = {"mlp_parquet": mlp_parquet, "tiny_transformer": tiny_transformer,
            "image_classifier": image_classifier}


class Zipped(torch.utils.data.Dataset):
    """Sample ``i`` of each dataset, as a tuple."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def __len__(self) -> int:
        return min(len(p) for p in self.parts)

    def __getitem__(self, i: int) -> tuple:
        return tuple(p[i] for p in self.parts)


class Together(nn.Module):
    """Every example's model; the forward is every example's step on its part of the batch
    (through the root's forward, so DDP and FSDP see one model)."""

    def __init__(self, tasks: dict[str, Task]) -> None:
        super().__init__()
        self.tasks = tasks
        self.parts = nn.ModuleDict({name: t.build_model() for name, t in tasks.items()})

    def bn_stats(self) -> torch.Tensor:
        """The image classifier's BatchNorm running statistics, summed in float64."""
        return sum(b.double().sum() for name, b in
                   self.parts["image_classifier"].named_buffers() if "running" in name)

    def forward(self, batch: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        metrics = {"bn_stats": self.bn_stats().detach()}
        total = 0
        for (name, task), part in zip(self.tasks.items(), batch, strict=True):
            loss, own = task.run_step(self.parts[name], part)
            metrics[f"{name}_loss"] = loss.detach()
            metrics.update({f"{name}_{k}": v for k, v in own.items()})
            total = total + loss
        return total, metrics


def step(model: nn.Module, batch: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The sum of the examples' losses, and each one's loss and metrics."""
    return model(batch)


def task() -> Task:
    """Every example at once; FSDP shards each example's units."""
    tasks = {name: module.task() for name, module in EXAMPLES.items()}

    def units(model: Together):
        for name, t in tasks.items():
            part = model.parts[name]
            yield from (t.shard_units(part) if t.shard_units else [part])

    return Task(model=lambda: Together(tasks), data=Zipped([t.data for t in tasks.values()]),
                eval_data=Zipped([t.eval_data for t in tasks.values()]), step=step,
                shard_units=units, tokens_per_sample=tiny_transformer.SEQ)
