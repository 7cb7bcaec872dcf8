"""A classifier's per-sample hits (top-1, top-5): metrics a task's step returns.

They live outside `hpctrain.train` so that a task (`hpctrain.tasks.images`) reports them without
depending on the trainer that loads it; the trainer and its exact validation sums
(`hpctrain.train.exact_eval`) add them up like any per-sample metric.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def topk_correct(logits: torch.Tensor, labels: torch.Tensor,
                 ks: Sequence[int] = (1, 5)) -> dict[str, torch.Tensor]:
    """Per-sample hits ``{"top1": 0/1 float vector, "top5": ...}``: the label is among the
    ``k`` highest logits (k capped at the number of classes)."""
    top = logits.topk(min(max(ks), logits.shape[-1]), dim=-1).indices
    hits = top == labels.unsqueeze(-1)
    return {f"top{k}": hits[:, :k].any(dim=-1).float() for k in ks}
