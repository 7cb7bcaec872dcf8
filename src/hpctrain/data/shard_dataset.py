"""A `TokenDataset` over the shards of a prepared directory, memory-mapped.

Samples are non-overlapping windows of ``seq_len + 1`` tokens inside one shard (consecutive
windows share one boundary token, as in `ContiguousTokens`); the last ``< seq_len`` tokens of each
shard are not used. With ``val_fraction`` > 0 the last ``floor(windows * val_fraction)`` windows
of every shard form the validation split and the rest the training split, so the split is a pure
function of (manifest, seq_len, val_fraction).

    ds = ShardTokens(load_manifest("runs/data/stdlib"), seq_len=256)
    ds.window(0)            # np.ndarray of 257 tokens

Shards prepared from fine-tuning examples carry loss masks: ``has_loss_mask`` is then true and
``mask_windows`` gives the masks of the same windows (1 where the token counts as a target).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from hpctrain.data.shards import Manifest
from hpctrain.errors import ConfigError, DataError

Split = Literal["train", "val"]


def split_windows(n: np.ndarray, val_fraction: float,
                  split: Split) -> tuple[np.ndarray, np.ndarray]:
    """(first window, window count) per group of ``n`` windows for one split."""
    n = np.asarray(n, dtype=np.int64)
    val = np.floor(n * val_fraction).astype(np.int64)
    if split == "val":
        return n - val, val
    return np.zeros_like(n), n - val


class ShardTokens:
    """Windows over all shards of a manifest; window ``i`` of the split in shard order."""

    def __init__(self, manifest: Manifest, seq_len: int, *, split: Split = "train",
                 val_fraction: float = 0.0, window_shards: int = 4,
                 vocab_size: int | None = None):
        self.manifest = manifest
        # Ids at or above this are refused per batch: the manifest's maxima are checked before
        # training, but a shard changed after its manifest was written would slip past them.
        self.id_limit = min(manifest.vocab_size, vocab_size or manifest.vocab_size)
        self.seq_len = seq_len
        self.split = split
        # Shards per shuffle window (read by `GlobalOrderSampler`): samples are shuffled within
        # a window of this many shards, so each rank reads few files at a time, sequentially.
        self.window_shards = window_shards
        ntok = np.array([int(s["tokens"]) for s in manifest.shards], dtype=np.int64)
        per_shard = np.maximum(0, (ntok - 1) // seq_len)
        self._first, counts = split_windows(per_shard, val_fraction, split)
        self.shard_sample_counts = counts
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._maps: list[np.ndarray | None] = [None] * len(counts)
        self.has_loss_mask = manifest.has_masks
        self._masks: list[np.ndarray | None] = [None] * len(counts)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _shard(self, s: int) -> np.ndarray:
        mm = self._maps[s]
        if mm is None:
            # A plain ndarray view of the memmap: slicing it skips np.memmap's Python overhead.
            mm = self._maps[s] = np.asarray(self.manifest.tokens(s)).view(np.ndarray)
        return mm

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, first token offset) of each sample index."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"sample index out of range [0, {len(self)})")
        shard = np.searchsorted(self._starts, indices, side="right") - 1
        local = indices - self._starts[shard] + self._first[shard]
        return shard, local * self.seq_len

    def window(self, index: int) -> np.ndarray:
        shard, start = self.locate(np.array([index]))
        s, a = int(shard[0]), int(start[0])
        w = self._shard(s)[a : a + self.seq_len + 1]
        self._check_ids(w[None, :], shard)
        return w

    def windows(self, indices: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Samples ``indices`` as one ``[len(indices), seq_len + 1]`` array (int64 by default)."""
        shard, start = self.locate(indices)
        width = self.seq_len + 1
        if out is None:
            out = np.empty((len(shard), width), dtype=np.int64)
        for row, (s, a) in enumerate(zip(shard.tolist(), start.tolist(), strict=True)):
            out[row] = self._shard(s)[a : a + width]
        self._check_ids(out, shard)
        return out

    def mask_windows(self, indices: np.ndarray) -> np.ndarray:
        """The loss masks of samples ``indices``, ``[len(indices), seq_len + 1]`` bool."""
        shard, start = self.locate(indices)
        width = self.seq_len + 1
        out = np.empty((len(shard), width), dtype=bool)
        for row, (s, a) in enumerate(zip(shard.tolist(), start.tolist(), strict=True)):
            mm = self._masks[s]
            if mm is None:
                mm = self._masks[s] = np.asarray(self.manifest.mask(s)).view(np.ndarray)
            out[row] = mm[a : a + width]
        return out

    def _check_ids(self, rows: np.ndarray, shard: np.ndarray) -> None:
        """Raise DataError naming the shard of the first row holding an id >= ``id_limit``."""
        if len(rows) and int(rows.max()) >= self.id_limit:
            row = int(np.argmax(rows.max(axis=1) >= self.id_limit))
            entry = self.manifest.shards[int(shard[row])]
            raise DataError(
                f"shard {str(self.manifest.root / entry['bin'])!r} holds token id "
                f"{int(rows[row].max())}, outside the vocabulary of {self.id_limit} ids (its "
                f"manifest records at most {entry.get('max_token_id', 'nothing')})",
                hint="the shard was changed after it was prepared; run `hpctrain data verify` "
                "on the directory and prepare the data again")


def check_split_size(n: int, split: Split, val_fraction: float) -> None:
    """Refuse an empty split with a hint."""
    if n == 0:
        raise ConfigError(
            f"the {split} split holds no samples (data.val_fraction = {val_fraction})",
            hint="raise data.val_fraction, shorten data.seq_len or prepare more data"
            if split == "val" else "lower data.val_fraction or prepare more data",
        )
