"""Exact distributed evaluation: every sample of a split counted once, gathered in one call.

The split is `ValidationSampler`'s: rank ``r`` of ``W`` takes samples ``r, r + W, ...`` in
micro-batches of equal count on every rank (the tail's empty slots are padding), so every rank
makes the same forward and collective calls and no sample is dropped or seen twice.
`rank_batches` turns each padded micro-batch into the real samples to run; `ExactSums` adds
each batch's values as sums over its real samples in float64 and gathers all of them across the
ranks in one all-reduce (`validate.global_sums`). Values given one per sample (e.g. the 0/1
hits of `hpctrain.observe.accuracy.topk_correct`) are summed exactly, so top-1/top-5 on N ranks
are the very numbers one process gets; a value given as the batch mean (a loss) is a mean over
the samples the step kept (a corrupt image is dropped), so it is weighted by that count and
averaged over all kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
import torch

from hpctrain.data.loader import ValidationSampler
from hpctrain.errors import HpctrainError
from hpctrain.train.validate import global_sums

__all__ = ["ExactSums", "ValidationSampler", "rank_batches"]


def rank_batches(sampler: ValidationSampler) -> Iterator[tuple[np.ndarray, int]]:
    """This rank's micro-batches as (indices to run, how many of them count).

    A micro-batch of padding only still runs one sample (counted 0 times): sharded models
    (FSDP) need every rank in every forward's collectives.
    """
    for indices, mask in sampler:
        n = int(mask.sum())
        yield (indices[mask] if n else indices[:1]), n


class ExactSums:
    """Named sums over samples (float64, on the device), gathered across ranks once."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums: dict[str, torch.Tensor] = {}
        self.count = 0
        self.kept = 0  # samples the scalar (batch mean) values are means over
        self.means: set[str] = set()  # the names given as batch means

    def add(self, values: Mapping[str, torch.Tensor], n: int) -> None:
        """Add one batch of ``n`` counted samples: a 1-D value holds one number per sample the
        step kept (fewer than ``n`` if it dropped some, e.g. corrupt images: those count as 0);
        a scalar value is the mean over the kept ones (as many as the 1-D values hold, else
        ``n``), weighted by that count. ``n = 0`` (padding) adds nothing, but names the
        values, so that every rank gathers the same ones."""
        if set(values) != set(self.sums) and self.sums:
            raise HpctrainError(f"evaluation values {sorted(values)} differ from earlier "
                                f"batches' {sorted(self.sums)}",
                                expected="the same names in every batch")
        for name, value in values.items():
            if not (value.dim() == 0 or (value.dim() == 1 and value.numel() <= max(n, 1))):
                raise HpctrainError(
                    f"evaluation value {name!r} has shape {tuple(value.shape)} for a batch of "
                    f"{n} samples", expected=f"a scalar (the batch mean) or shape ({n},)")
        kept = min([n] + [v.numel() for v in values.values() if v.dim() == 1]) if n else 0
        for name, value in values.items():
            value = value.detach()
            if name not in self.sums:
                self.sums[name] = torch.zeros((), dtype=torch.float64, device=self.device)
            if value.dim() == 1:
                if n:
                    self.sums[name] += value.double().sum()
            else:
                self.means.add(name)
                if kept:  # a mean over nothing (NaN, a placeholder) adds nothing
                    self.sums[name] += value.double() * kept
        self.count += n
        self.kept += kept

    def reduce(self) -> tuple[dict[str, float], int]:
        """The means over every rank's samples, and how many samples there were.

        Collective: every rank calls it after the same number of ``add`` calls (`rank_batches`
        gives every rank the same number of batches).
        """
        counts = {k: torch.tensor(float(v), dtype=torch.float64, device=self.device)
                  for k, v in (("\0count", self.count), ("\0kept", self.kept))}
        totals = global_sums({**self.sums, **counts})
        total, kept = int(totals.pop("\0count")), int(totals.pop("\0kept"))
        means = {}
        for k, v in totals.items():
            over = kept if k in self.means else total
            means[k] = v / over if over else float("nan")
        return means, total
