"""ViT-B/16 on packed JPEG shards: torchvision's model where torchvision imports (the GPU
image), else hpctrain's own with the same parameter names (`hpctrain.models.vision`).

    hpctrain data pack-images photos/ --out shards --val-fraction 0.02     # class folders
    hpctrain train examples/vit_b16.py --nproc 8 task_args.data=shards optim.lr=5e-4
    # on a CPU, tiny:
    hpctrain train examples/vit_b16.py task_args.data=shards task_args.model=vit_tiny \\
        task_args.image_size=32 train.precision=fp32

As examples/resnet50_images.py: the data path, the loss and validation are the built-in image
task's; configs/vit-b16-images.yaml is the full recipe (AdamW, warmup + cosine).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from hpctrain.task import Task
from hpctrain.tasks.images import classifier


def torchvision_vit_b_16(num_classes: int, image_size: int) -> nn.Module:
    """torchvision's ViT-B/16 at ``image_size``."""
    from torchvision.models import vit_b_16

    return vit_b_16(num_classes=num_classes, image_size=image_size)


def task(data: str = "", model: str = "vit_b_16", **settings: Any) -> Task:
    """The classifier over ``data`` (the packed shards; unset: refused, naming the key);
    settings as in ImageTaskConfig."""
    build = None
    if model == "vit_b_16":
        try:
            import torchvision  # noqa: F401  (only on images built with a matching torch)
            build = torchvision_vit_b_16
        except Exception:  # not installed, or built for another torch: ours has its names
            pass
    return classifier(build, data=data, model=model, **settings)
