"""A small ResNet image classifier, in plain PyTorch, on generated images.

    hpctrain train examples/image_classifier.py --nproc 2 train.steps=200 train.precision=fp32

torchvision's ResNet-50 and ViT-B/16 are the intended models, but PyPI's torchvision does not
import beside this project's CPU build of torch, so the network is written out here (the same
residual blocks, BatchNorm included, at a toy size). The images are generated: each of the 10
classes is a fixed pattern, plus noise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.task import Task, sample_rng

CLASSES, SIZE = 10, 16


class Residual(nn.Module):
    """conv-BN-ReLU-conv-BN plus a (strided 1x1 when the shape changes) shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = (nn.Sequential() if stride == 1 and cin == cout else
                      nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                    nn.BatchNorm2d(cout)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


class ResNet(nn.Module):
    """Stem, three residual stages, global pooling, classifier."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU())
        self.stages = nn.Sequential(Residual(width, width, 1), Residual(width, 2 * width, 2),
                                    Residual(2 * width, 4 * width, 2))
        self.head = nn.Linear(4 * width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


class Images(torch.utils.data.Dataset):
    """``n`` images: the pattern of class ``i % 10`` plus noise seeded by the index, flipped at
    random (``sample_rng()``: the same flips after a resume and on any number of ranks)."""

    def __init__(self, n: int, offset: int = 0) -> None:
        self.n, self.offset = n, offset
        self.patterns = torch.randn(CLASSES, 3, SIZE, SIZE,
                                    generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        i += self.offset
        label = i % CLASSES
        noise = torch.randn(3, SIZE, SIZE, generator=torch.Generator().manual_seed(i + 1))
        image = self.patterns[label] + 2 * noise
        if torch.rand((), generator=sample_rng()) < 0.5:
            image = image.flip(-1)
        return image, label


def step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """Cross entropy, and top-1 accuracy."""
    images, labels = batch
    logits = model(images)
    return F.cross_entropy(logits, labels), {"top1": (logits.argmax(1) == labels).float().mean()}


def task() -> Task:
    """ResNet, 4096 training images, 512 held out."""
    return Task(model=ResNet, data=Images(4096), eval_data=Images(512, offset=4096), step=step,
                shard_units=lambda m: [m.stem, *m.stages])
