"""Token datasets as windows of ``seq_len + 1`` tokens (inputs and the shifted targets).

`TokenDataset` is what the loader and a mixture need of a source; `ContiguousTokens` and
`SliceWindows` are the in-memory ones (the stdlib corpus and its splits), `ShardTokens`
(`hpctrain.data.shard_dataset`) the one over prepared shards; `gather_windows` stacks samples
and `gather_masks` their loss masks, where a source has them.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class TokenDataset(Protocol):
    """What the loader needs of a token source: a count and random access to windows."""

    seq_len: int

    def __len__(self) -> int: ...

    def window(self, index: int) -> np.ndarray:
        """Tokens ``seq_len + 1`` long for sample ``index``."""
        ...


class ContiguousTokens:
    """Non-overlapping windows over one token array (windows share one boundary token)."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def window(self, index: int) -> np.ndarray:
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]


class SliceWindows:
    """Windows ``[start, start + count)`` of another dataset, renumbered from 0."""

    def __init__(self, base: TokenDataset, start: int, count: int):
        self.base, self.start, self.count = base, start, count
        self.seq_len = base.seq_len

    def __len__(self) -> int:
        return self.count

    def window(self, index: int) -> np.ndarray:
        if not 0 <= index < self.count:
            raise IndexError(f"sample {index} out of range [0, {self.count})")
        return self.base.window(self.start + index)


def gather_masks(dataset: TokenDataset, indices: np.ndarray) -> np.ndarray | None:
    """The loss masks of samples ``indices`` (bool, like `gather_windows`), or None when the
    dataset has none (every target counts)."""
    if not getattr(dataset, "has_loss_mask", False):
        return None
    return dataset.mask_windows(np.asarray(indices, dtype=np.int64))


def gather_windows(dataset: TokenDataset, indices: np.ndarray) -> np.ndarray:
    """Samples ``indices`` stacked as ``[len(indices), seq_len + 1]`` int64."""
    fast = getattr(dataset, "windows", None)
    if fast is not None:
        return fast(indices)
    out = np.empty((len(indices), dataset.seq_len + 1), dtype=np.int64)
    for row, i in enumerate(np.asarray(indices).tolist()):
        out[row] = dataset.window(i)
    return out
