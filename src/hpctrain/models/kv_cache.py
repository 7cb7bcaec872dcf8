"""Keys and values of every block for the positions fed so far, for incremental decoding
(`hpctrain.models.generate`): one cache for every family, each of which says how to make one
for its model (the spec's ``kv_cache``)."""

from __future__ import annotations

import torch


class LayerKV:
    """One block's view of a `KVCache`: its key and value buffers and the position reached."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, pos: int):
        self.keys, self.values, self.pos = keys, values, pos

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' `k`, `v` `[B, T, kv_heads, head_dim]`; return all so far."""
        end = self.pos + k.shape[1]
        self.keys[:, self.pos:end] = k
        self.values[:, self.pos:end] = v
        return self.keys[:, :end], self.values[:, :end]


class KVCache:
    """Keys and values of every block for the positions fed so far (incremental decoding)."""

    def __init__(self, n_layers: int, batch: int, max_len: int, n_kv_heads: int, head_dim: int,
                 device: torch.device | str, dtype: torch.dtype):
        shape = (batch, max_len, n_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.max_len = max_len
        self.pos = 0

    def layer(self, i: int) -> LayerKV:
        """Block `i`'s buffers at the current position."""
        return LayerKV(self.keys[i], self.values[i], self.pos)
