"""Distributed validation with exact global metrics.

Each rank evaluates its share of the held-out split (``ValidationSampler``: equal batch counts on
every rank, padding rows masked out), sums token losses in float64 and the ranks add their sums:
every validation token is counted exactly once whatever the number of ranks.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.data.loader import TokenDataset, ValidationSampler, validation_batches


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: TokenDataset, *, micro_batch: int, rank: int,
             world_size: int, device: torch.device, autocast: torch.dtype | None) -> dict:
    """Global mean loss, perplexity and token count over the whole validation split."""
    sampler = ValidationSampler(len(dataset), world_size, rank, micro_batch)
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
    ctx = (torch.autocast(device.type, dtype=autocast) if autocast is not None
           else contextlib.nullcontext())
    for inputs, targets, mask in validation_batches(dataset, sampler, device):
        with ctx:
            logits = model(inputs)
        token_loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                     reduction="none").view(targets.shape)
        keep = mask.to(torch.float64)
        totals[0] += (token_loss.double().sum(dim=1) * keep).sum()
        totals[1] += keep.sum() * targets.shape[1]
    if world_size > 1:
        dist.all_reduce(totals)
    loss_sum, tokens = totals.tolist()
    loss = loss_sum / tokens
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": int(tokens),
            "val_samples": len(dataset)}
