"""The training loss: summed next-token cross entropy, on whole or vocabulary-split logits."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from hpctrain.data.loader import IGNORE_INDEX
from hpctrain.parallel.tensor import tp_loss_fn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross entropy in fp32; ``IGNORE_INDEX`` targets (padding) add 0."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def build_loss_fn(tp: int, mesh: DeviceMesh, vocab_size: int, *, compile: bool) -> LossFn:
    """The loss a rank applies to its model's logits (summed over the micro-batch's tokens)."""
    if tp > 1:
        # The logits stay split along the vocabulary: the loss works on the shards.
        return tp_loss_fn(mesh["tp"], vocab_size)
    # Compiled, the fp32 upcast, log-softmax and gather fuse instead of materialising
    # the [tokens, vocab] fp32 logits several times.
    return torch.compile(cross_entropy_loss) if compile else cross_entropy_loss
