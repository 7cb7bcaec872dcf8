"""``hpctrain eval``: the perplexity of a model on a prepared split, in one process.

The loss is the mean over the targets that count: with loss masks (fine-tuning data) only the
response tokens, as training counts them. The split is the one training uses
(`hpctrain.data.shard_dataset`: the last ``val_fraction`` of each shard's windows), so a run
evaluated on its own data with its own settings measures its held-out loss.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from hpctrain.data.loader import IGNORE_INDEX, ignored_targets
from hpctrain.data.windows import TokenDataset, gather_windows


@torch.no_grad()
def perplexity(model: torch.nn.Module, dataset: TokenDataset, micro_batch: int,
               max_samples: int | None = None) -> dict[str, float]:
    """``{"loss", "ppl", "tokens", "samples"}`` of ``model`` over the first ``max_samples``
    samples of ``dataset`` (all by default)."""
    device = next(model.parameters()).device
    n = len(dataset) if max_samples is None else min(len(dataset), max_samples)
    loss_sum, tokens = 0.0, 0
    for lo in range(0, n, micro_batch):
        indices = np.arange(lo, min(lo + micro_batch, n), dtype=np.int64)
        t = torch.from_numpy(gather_windows(dataset, indices)).to(device)
        targets = t[:, 1:]
        ignored = ignored_targets(dataset, indices, np.ones(len(indices), dtype=bool))
        if ignored is not None:
            targets = targets.masked_fill(ignored.to(device), IGNORE_INDEX)
        logits = model(t[:, :-1])
        loss_sum += F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                    ignore_index=IGNORE_INDEX, reduction="sum").item()
        tokens += int((targets != IGNORE_INDEX).sum())
    loss = loss_sum / tokens if tokens else float("nan")
    return {"loss": loss, "ppl": math.exp(min(loss, 700.0)) if tokens else float("nan"),
            "tokens": tokens, "samples": n}
