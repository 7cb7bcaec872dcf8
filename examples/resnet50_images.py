"""ResNet-50 on packed JPEG shards: torchvision's model where torchvision imports (the GPU
image), else hpctrain's own with the same parameter names (`hpctrain.models.vision`).

    hpctrain data pack-images photos/ --out shards --val-fraction 0.02     # class folders
    hpctrain train examples/resnet50_images.py --nproc 8 task_args.data=shards
    # on a CPU, tiny:
    hpctrain train examples/resnet50_images.py task_args.data=shards \\
        task_args.model=resnet_tiny task_args.image_size=32 train.precision=fp32

Reading, decoding (nvJPEG on the GPU), augmentation, label smoothing and exact top-1/top-5
validation are the built-in image task's (`hpctrain.tasks.images`, whose settings are the
``task_args``); only the model is this file's. configs/resnet50-images.yaml is the full recipe.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hpctrain.task import Task
from hpctrain.tasks.images import classifier


def torchvision_resnet50(num_classes: int, image_size: int) -> nn.Module:
    """torchvision's ResNet-50, its last BN gain in each block at 0."""
    from torchvision.models import resnet50

    return resnet50(num_classes=num_classes, zero_init_residual=True)


def task(data: str = "", model: str = "resnet50", **settings: Any) -> Task:
    """The classifier over ``data`` (the packed shards; unset: refused, naming the key);
    settings as in ImageTaskConfig."""
    build = None
    if model == "resnet50":
        try:
            import torchvision  # noqa: F401  (only on images built with a matching torch)
            build = torchvision_resnet50
        except Exception:  # not installed, or built for another torch: ours has its names
            pass
    return classifier(build, data=data, model=model, **settings)
