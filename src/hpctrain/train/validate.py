"""Distributed validation with exact global metrics.

Each data-parallel rank evaluates its share of the held-out split (``ValidationSampler``: equal
batch counts on every rank, padding rows masked out), sums token losses in float64 and the ranks
add their sums: every validation token is counted exactly once whatever the layout.

With tensor parallelism the logits stay split along the vocabulary and ``loss_fn`` (the
vocabulary-parallel loss) sums the token losses from the shards; with pipeline parallelism the
batches flow forward through the schedule and the last stage sums them. Either way every rank of
a model replica holds or computes the same sum, so only one of them (``holds_loss``) adds it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hpctrain.data.loader import IGNORE_INDEX, TokenDataset, ValidationSampler, validation_batches
from hpctrain.parallel.pipeline import Pipeline


@torch.no_grad()
def evaluate(model: torch.nn.Module, dataset: TokenDataset, *, micro_batch: int, rank: int,
             world_size: int, device: torch.device, autocast: torch.dtype | None,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             pipeline: Pipeline | None = None, holds_loss: bool = True,
             loss_chunks: int = 0, max_samples: int = 0) -> dict:
    """Global mean loss, perplexity and token count over the validation split, or over
    ``max_samples`` of its samples spread evenly across it (0: all of them).

    The record says what was covered: ``val_samples`` evaluated of ``val_split_samples``,
    ``val_tokens`` the target tokens counted, ``val_batches`` the micro-batches of each rank.

    ``rank`` and ``world_size`` are data-parallel coordinates (ranks that see different
    samples); sums are added over all ranks of the job. ``loss_fn(logits, targets)`` (summed,
    padding targets ignored) replaces the plain cross entropy; ``pipeline`` replaces ``model``;
    ``loss_chunks`` > 0 has the model sum the loss over token chunks, as in training.
    With a pipeline, ``micro_batch`` must be the training step's batch per data-parallel rank,
    which the schedule cuts into its micro-batches.
    """
    sampler = ValidationSampler(len(dataset), world_size, rank, micro_batch, max_samples)
    totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, token count
    ctx = (torch.autocast(device.type, dtype=autocast) if autocast is not None
           else contextlib.nullcontext())
    for inputs, targets, mask in validation_batches(dataset, sampler, device):
        if pipeline is None and loss_fn is None and not loss_chunks:
            with ctx:
                logits = model(inputs)
            token_loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(),
                                         reduction="none").view(targets.shape)
            keep = mask.to(torch.float64)
            totals[0] += (token_loss.double().sum(dim=1) * keep).sum()
            totals[1] += ((targets != IGNORE_INDEX) & mask[:, None]).sum()
            continue
        # Padding rows get the ignored target: a summed loss then counts real tokens only.
        masked = targets.masked_fill(~mask[:, None], IGNORE_INDEX)
        if pipeline is not None:
            loss_sum = pipeline.eval_loss_sum(inputs, masked)
        elif loss_chunks:
            with ctx:
                loss_sum = model(inputs, targets=masked, loss_chunks=loss_chunks)
        else:
            with ctx:
                loss_sum = loss_fn(model(inputs), masked)
        if holds_loss:
            totals[0] += loss_sum.double()
            totals[1] += (masked != IGNORE_INDEX).sum()
    sums = global_sums({"loss": totals[0], "tokens": totals[1]})
    loss = sums["loss"] / sums["tokens"]
    tokens = sums["tokens"]
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 700.0)), "val_tokens": int(tokens),
            "val_samples": sampler.num_samples, "val_split_samples": len(dataset),
            "val_batches": len(sampler)}


def global_sums(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Each scalar summed over all ranks of the job, in float64 (one all-reduce, one sync)."""
    names = list(sums)
    totals = torch.stack([torch.as_tensor(sums[k]).double().reshape(()) for k in names])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    return dict(zip(names, totals.tolist(), strict=True))
