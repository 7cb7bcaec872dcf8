"""ResNet (He et al. 2015) in plain PyTorch, with torchvision's parameter names.

``torchvision.models.resnet50().state_dict()`` loads into ``resnet(50)`` key for key, so weights
trained either way move across; torchvision itself is not needed (it does not import beside a
CPU-only build of torch). ``small_input=True`` swaps the 7x7/2 stem and max-pool for a 3x3/1 stem,
the usual change for 32x32 images (CIFAR-style), which would otherwise shrink to 1x1 by layer3.
"""

from __future__ import annotations

import torch
from torch import nn

# Blocks per stage, and whether each is a bottleneck (1x1-3x3-1x1, 4x wider out), by depth.
DEPTHS: dict[int, tuple[tuple[int, int, int, int], bool]] = {
    18: ((2, 2, 2, 2), False),
    34: ((3, 4, 6, 3), False),
    50: ((3, 4, 6, 3), True),
    101: ((3, 4, 23, 3), True),
    152: ((3, 8, 36, 3), True),
}


def _downsample(cin: int, cout: int, stride: int) -> nn.Sequential | None:
    """The shortcut's projection where the block changes shape (torchvision's ``downsample``)."""
    if stride == 1 and cin == cout:
        return None
    return nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))


class BasicBlock(nn.Module):
    """3x3-3x3 residual block (ResNet-18/34)."""

    expansion = 1

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.downsample = _downsample(cin, width, stride)

    def last_bn(self) -> nn.BatchNorm2d:
        """The BatchNorm whose gain zero-init sets to 0 (the block then starts as identity)."""
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    """1x1-3x3-1x1 residual block, stride on the 3x3 (torchvision's "ResNet v1.5")."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _downsample(cin, cout, stride)

    def last_bn(self) -> nn.BatchNorm2d:
        """The BatchNorm whose gain zero-init sets to 0 (the block then starts as identity)."""
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """Stem, four stages of residual blocks, global average pool, linear classifier."""

    def __init__(self, depth: int = 50, num_classes: int = 1000, *, width: int = 64,
                 zero_init_residual: bool = False, small_input: bool = False) -> None:
        super().__init__()
        if depth not in DEPTHS:
            raise ValueError(f"ResNet depth {depth}: one of {sorted(DEPTHS)}")
        layers, bottleneck = DEPTHS[depth]
        block = Bottleneck if bottleneck else BasicBlock
        if small_input:
            self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        else:
            self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.Identity() if small_input else nn.MaxPool2d(3, 2, 1)
        cin = width
        for i, n in enumerate(layers):
            stage_width = width * 2 ** i
            blocks = []
            for j in range(n):
                blocks.append(block(cin, stage_width, 2 if (j == 0 and i > 0) else 1))
                cin = stage_width * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)
        self.reset_parameters(zero_init_residual)

    def blocks(self) -> list[nn.Module]:
        """The residual blocks in order (the units FSDP shards and checkpointing may wrap)."""
        return [b for i in range(1, 5) for b in getattr(self, f"layer{i}")]

    @torch.no_grad()
    def reset_parameters(self, zero_init_residual: bool = False) -> None:
        """torchvision's initialisation; optionally each block's last BN gain at 0
        (Goyal et al. 2017: every block starts as the identity, which helps large batches)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                m.reset_parameters()
        if zero_init_residual:
            for b in self.blocks():
                nn.init.zeros_(b.last_bn().weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
