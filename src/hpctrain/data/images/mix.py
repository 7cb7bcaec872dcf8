"""Mixup and CutMix of a training batch on its device, drawn from the batch's own generator.

    mixing = Mixing("both", mixup_alpha=0.8, cutmix_alpha=1.0)
    x, lam = mixing(x, g)    # g: `batch_generator(seed, sources)`, after the crops' draws
    loss = lam * CE(logits, labels) + (1 - lam) * CE(logits, labels.flip(0))

Image ``i`` of a batch is mixed with image ``B-1-i`` (timm's "batch" mode: one draw per batch):
Mixup blends the two, ``lam * x + (1 - lam) * partner`` with ``lam ~ Beta(a, a)``; CutMix pastes
the partner's pixels into a box of area ``1 - lam`` at a uniform centre, and ``lam`` becomes the
area left after the box is clipped to the image. ``"both"`` picks one of the two per batch with
equal odds (DeiT's switch probability 0.5). Every draw comes from the generator seeded by the
batch's sample keys, a fixed count per batch: a resumed run mixes its batches the same way.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch

MixMode = Literal["none", "mixup", "cutmix", "both"]


class Mixing:
    """Mixes training batches as ``mode`` says; ``__call__`` returns the batch and its lam."""

    def __init__(self, mode: MixMode, mixup_alpha: float = 0.8, cutmix_alpha: float = 1.0):
        if mode not in ("mixup", "cutmix", "both"):
            raise ValueError(f"mixing mode {mode!r}: one of mixup, cutmix, both")
        if mixup_alpha <= 0 or cutmix_alpha <= 0:
            raise ValueError(f"Beta parameters {mixup_alpha}, {cutmix_alpha} must be > 0")
        self.mode, self.mixup_alpha, self.cutmix_alpha = mode, mixup_alpha, cutmix_alpha

    def __call__(self, x: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, float]:
        """``x`` (B, C, H, W) mixed with ``x.flip(0)``, and the weight of its own labels."""
        u = torch.rand(3, generator=g, dtype=torch.float64).tolist()
        # Beta has no torch.Generator argument: numpy's, seeded from the batch's generator.
        rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=g)))
        cutmix = self.mode == "cutmix" or (self.mode == "both" and u[0] < 0.5)
        lam = float(rng.beta(*(2 * [self.cutmix_alpha if cutmix else self.mixup_alpha])))
        if x.shape[0] < 2:
            return x, 1.0  # no partner
        partner = x.flip(0)
        if not cutmix:
            return torch.lerp(partner, x, lam), lam
        H, W = x.shape[-2:]
        cut = math.sqrt(1 - lam)
        h, w = int(H * cut), int(W * cut)
        cy, cx = int(u[1] * H), int(u[2] * W)
        top, bottom = max(cy - h // 2, 0), min(cy + h // 2, H)
        left, right = max(cx - w // 2, 0), min(cx + w // 2, W)
        x = x.clone()
        x[..., top:bottom, left:right] = partner[..., top:bottom, left:right]
        return x, 1 - (bottom - top) * (right - left) / (H * W)
