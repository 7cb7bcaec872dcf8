"""Several token datasets drawn in fixed proportions, in an order that does not depend on ranks.

    data:
      source: mix
      mix:
        - {path: data/web, weight: 0.7}
        - {path: data/code, weight: 0.3}

An epoch of the mixture is ``sum(len(source))`` samples (configurable). Its global order is a pure
function of (seed, epoch, manifests), so the sampler's guarantees (equal counts per rank, exact
resume on any world size) hold as for one dataset:

- positions are cut into blocks of ``BLOCK`` samples; source ``k`` owns exactly
  ``floor(w_k * P)`` of the first ``P`` positions at every block boundary and the heaviest source
  takes the rest, so every share is exact to within one sample (the heaviest: fewer than the
  number of sources);
- inside a block the sources' slots are permuted by a generator seeded with (seed, epoch, block);
- the ``j``-th slot of source ``k`` (counted from the start of training) takes position ``j`` of
  that source's own stream: its window-shuffled order, epoch after epoch. A heavily weighted
  small source therefore repeats (upsampling) and a lightly weighted one is read only partly per
  mixed epoch and continues where it stopped in the next.

Validation (``split="val"``) is the plain concatenation of the sources' validation splits, so each
held-out sample is counted exactly once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hpctrain.data.order import BatchLayout, GlobalOrderSampler
from hpctrain.data.windows import gather_masks, gather_windows
from hpctrain.errors import ConfigError

# Positions per mixing block; must be >= (number of sources)^2 for the counts to be monotone.
BLOCK = 8192


def source_seed(seed: int, k: int) -> int:
    """Seed of source ``k``'s own order (independent streams per source)."""
    return int(np.random.SeedSequence([seed, k, 0x6D6978]).generate_state(1)[0])


class MixedTokens:
    """Samples of several `TokenDataset`s; index ``offset[k] + i`` is sample ``i`` of source k."""

    def __init__(self, sources: Sequence, weights: Sequence[float], *, epoch_samples: int = 0,
                 names: Sequence[str] | None = None, weighted: bool = True):
        if not sources:
            raise ConfigError("data.mix is empty", expected="at least one {path, weight}")
        if len(weights) != len(sources):
            raise ValueError(f"{len(weights)} weights for {len(sources)} sources")
        names = list(names or [f"source {k}" for k in range(len(sources))])
        w = np.asarray(weights, dtype=np.float64)
        if not np.all(np.isfinite(w)) or (w <= 0).any():
            raise ConfigError(f"data.mix weights {list(weights)} must all be > 0")
        seqs = {s.seq_len for s in sources}
        if len(seqs) != 1:
            raise ValueError(f"sources have different seq_len: {sorted(seqs)}")
        self.seq_len = seqs.pop()
        self.sources = list(sources)
        self.names = names
        self.weights = w / w.sum()
        self.sizes = np.array([len(s) for s in sources], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        # Without weights (a validation split) the mixture is the plain concatenation.
        self.weighted = weighted
        if weighted:
            for name, size, wk in zip(names, self.sizes, self.weights, strict=True):
                if size == 0:
                    raise ConfigError(f"data.mix source {name} holds no samples (weight {wk:.3g})",
                                      hint="prepare more data or shorten data.seq_len")
            if len(sources) ** 2 > BLOCK:
                raise ConfigError(f"data.mix has {len(sources)} sources, at most "
                                  f"{int(BLOCK ** 0.5)} are supported")
        self.epoch_samples = int(epoch_samples or self.sizes.sum())
        # Sources in the order their counts are computed: the heaviest last (it takes the rest).
        self._last = int(np.argmax(self.weights))
        self._orders: list = []
        self._seed: int | None = None
        self._block_cache: tuple[int, int, np.ndarray, np.ndarray] | None = None
        # Masks if any source has them; the samples of a source without count every target.
        self.has_loss_mask = any(getattr(s, "has_loss_mask", False) for s in self.sources)

    def __len__(self) -> int:
        return self.epoch_samples if self.weighted else int(self.offsets[-1])

    # -- random access (the loader's side) ----------------------------------------------------

    def window(self, index: int) -> np.ndarray:
        k = int(np.searchsorted(self.offsets, index, side="right")) - 1
        if not 0 <= index < self.offsets[-1]:
            raise IndexError(f"sample {index} out of range [0, {int(self.offsets[-1])})")
        return self.sources[k].window(index - int(self.offsets[k]))

    def windows(self, indices: np.ndarray) -> np.ndarray:
        """Samples ``indices`` (global, as returned by `global_order`) stacked as int64."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty((len(indices), self.seq_len + 1), dtype=np.int64)
        src = np.searchsorted(self.offsets, indices, side="right") - 1
        for k in np.unique(src).tolist():
            rows = np.flatnonzero(src == k)
            out[rows] = gather_windows(self.sources[k], indices[rows] - self.offsets[k])
        return out

    def mask_windows(self, indices: np.ndarray) -> np.ndarray:
        """Loss masks of samples ``indices``, all true for a source without masks."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.ones((len(indices), self.seq_len + 1), dtype=bool)
        src = np.searchsorted(self.offsets, indices, side="right") - 1
        for k in np.unique(src).tolist():
            rows = np.flatnonzero(src == k)
            masks = gather_masks(self.sources[k], indices[rows] - self.offsets[k])
            if masks is not None:
                out[rows] = masks
        return out

    # -- the order ------------------------------------------------------------------------------

    def cumulative_counts(self, positions: np.ndarray) -> np.ndarray:
        """``[len(positions), K]``: slots of each source among the first ``P`` positions."""
        p = np.asarray(positions, dtype=np.int64)[:, None]
        counts = np.floor(self.weights[None, :] * p).astype(np.int64)
        counts[:, self._last] = 0
        counts[:, self._last] = p[:, 0] - counts.sum(axis=1)
        return counts

    def _block(self, seed: int, epoch: int, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, slot number within the epoch) of each position of block ``b``."""
        c = self._block_cache
        if c is not None and c[:2] == (epoch, b):
            return c[2], c[3]
        lo = b * BLOCK
        hi = min(lo + BLOCK, self.epoch_samples)
        first, last = self.cumulative_counts(np.array([lo, hi]))
        quota = last - first
        labels = np.repeat(np.arange(len(quota)), quota)
        labels = labels[np.random.default_rng([seed, epoch, b, 0x6D6978]).permutation(len(labels))]
        # Rank of each position among the same source's positions of this block.
        order = np.argsort(labels, kind="stable")
        rank = np.empty(len(labels), dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(quota)[:-1]])
        rank[order] = np.arange(len(labels)) - starts[labels[order]]
        slot = first[labels] + rank
        self._block_cache = (epoch, b, labels, slot)
        return labels, slot

    def _source_orders(self, seed: int) -> list:
        if self._seed != seed:
            self._orders = []
            for k, src in enumerate(self.sources):
                s = GlobalOrderSampler(int(self.sizes[k]), BatchLayout(1, 1, 1, 0),
                                       source_seed(seed, k))
                groups = getattr(src, "shard_sample_counts", None)
                if groups is not None:
                    s.set_groups(groups, getattr(src, "window_shards", 4))
                self._orders.append(s)
            self._seed = seed
        return self._orders

    def _stream(self, seed: int, k: int, pos: np.ndarray) -> np.ndarray:
        """Sample indices (within source ``k``) at positions ``pos`` of its endless stream."""
        sampler = self._source_orders(seed)[k]
        n = int(self.sizes[k])
        out = np.empty(len(pos), dtype=np.int64)
        ep, within = np.divmod(pos, n)
        # Positions are increasing within a block, so each source epoch is one contiguous range.
        for e in np.unique(ep).tolist():
            rows = np.flatnonzero(ep == e)
            lo, hi = int(within[rows].min()), int(within[rows].max()) + 1
            out[rows] = sampler.order(e, lo, hi)[within[rows] - lo]
        return out

    def global_order(self, seed: int, epoch: int, start: int, stop: int) -> np.ndarray:
        """Global sample indices at positions ``[start, stop)`` of epoch ``epoch``."""
        if not self.weighted:
            raise RuntimeError("an unweighted (validation) mixture has no training order")
        if not 0 <= start <= stop <= self.epoch_samples:
            raise IndexError(f"positions [{start}, {stop}) outside the epoch of "
                             f"{self.epoch_samples} samples")
        per_epoch = self.cumulative_counts(np.array([self.epoch_samples]))[0]
        out = []
        pos = start
        while pos < stop:
            b = pos // BLOCK
            lo = b * BLOCK
            hi = min(stop, lo + BLOCK, self.epoch_samples)
            labels, slot = self._block(seed, epoch, b)
            labels, slot = labels[pos - lo : hi - lo], slot[pos - lo : hi - lo]
            idx = np.empty(len(labels), dtype=np.int64)
            for k in np.unique(labels).tolist():
                rows = np.flatnonzero(labels == k)
                stream_pos = epoch * int(per_epoch[k]) + slot[rows]
                idx[rows] = self.offsets[k] + self._stream(seed, k, stream_pos)
            out.append(idx)
            pos = hi
        return np.concatenate(out) if out else np.empty(0, dtype=np.int64)
