"""Image classifiers in plain PyTorch with torchvision's parameter names: ResNet and ViT.

    from hpctrain.models.vision import build, flops_per_sample
    model = build("resnet50", num_classes=1000)       # torchvision.models.resnet50's names
    flops_per_sample("resnet50", image_size=224)      # forward + backward FLOPs, ~24.5e9

Names: ``resnet18/34/50/101/152``, ``resnet_tiny`` (ResNet-18 at width 8 with a 3x3 stem, for
CPU tests), ``vit_b_16``, ``vit_l_16``, ``vit_tiny`` (patch 4, 2 layers, width 32).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from hpctrain.errors import ConfigError
from hpctrain.models.vision.resnet import DEPTHS, ResNet
from hpctrain.models.vision.vit import VIT_SIZES, VisionTransformer

__all__ = ["MODELS", "VIT_SIZES", "ResNet", "VisionTransformer", "build", "flops_per_sample"]


def _resnet(depth: int, **fixed) -> Callable[..., nn.Module]:
    def make(num_classes: int, image_size: int, zero_init_residual: bool = False) -> nn.Module:
        del image_size  # convolutional: any size
        return ResNet(depth, num_classes, zero_init_residual=zero_init_residual, **fixed)
    return make


def _vit(size: str) -> Callable[..., nn.Module]:
    def make(num_classes: int, image_size: int, zero_init_residual: bool = False) -> nn.Module:
        del zero_init_residual  # a ResNet option; ViT's head starts at zero anyway
        return VisionTransformer(image_size=image_size, num_classes=num_classes,
                                 **VIT_SIZES[size])
    return make


# name -> factory(num_classes, image_size, zero_init_residual)
MODELS: dict[str, Callable[..., nn.Module]] = {
    **{f"resnet{d}": _resnet(d) for d in DEPTHS},
    "resnet_tiny": _resnet(18, width=8, small_input=True),
    **{name: _vit(name) for name in VIT_SIZES},
}


def build(name: str, num_classes: int = 1000, image_size: int = 224, *,
          zero_init_residual: bool = False) -> nn.Module:
    """The classifier called ``name`` (see MODELS), freshly initialised."""
    if name not in MODELS:
        raise ConfigError(f"image model {name!r} is not known", expected=", ".join(MODELS),
                          hint="e.g. resnet50 or vit_b_16; resnet_tiny / vit_tiny for CPU tests")
    return MODELS[name](num_classes, image_size, zero_init_residual)


@functools.cache
def flops_per_sample(name: str, image_size: int = 224, num_classes: int = 1000) -> float:
    """Forward + backward FLOPs of one image (3x the forward's, counted once on the meta
    device by PyTorch's flop counter: convolutions, matmuls and attention)."""
    with torch.device("meta"):
        model = build(name, num_classes, image_size)
        x = torch.empty(1, 3, image_size, image_size)
    with FlopCounterMode(display=False) as counter:
        model(x)
    return 3.0 * counter.get_total_flops()
