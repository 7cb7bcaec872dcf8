"""Keys and values of every block for the positions fed so far, for incremental decoding
(`hpctrain.models.generate`): one cache for every family, each of which says how to make one
for its model (the spec's ``kv_cache``), and the causal attention over it that the families'
attention layers share."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cache: LayerKV | None = None) -> torch.Tensor:
    """Attention of ``q`` over ``k``, ``v`` (all ``[B, T, heads, head_dim]``, fewer kv heads
    allowed) where each position sees only earlier ones; with ``cache`` the T new positions
    follow the cached ones, whose keys they see too. Returns ``[B, T, heads, head_dim]``."""
    seqlen = q.shape[1]
    mask, causal = None, True
    if cache is not None:
        past = cache.pos
        k, v = cache.extend(k, v)
        if past and seqlen == 1:
            causal = False  # one new query sees every cached position
        elif past:
            # New query i sits at position past + i and sees keys up to there.
            mask = torch.ones(seqlen, past + seqlen, dtype=torch.bool,
                              device=q.device).tril(diagonal=past)
            causal = False
    # SDPA wants [B, heads, T, head_dim]; enable_gqa shares each kv head across its q group.
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), attn_mask=mask, is_causal=causal,
                                         enable_gqa=True)
    return out.transpose(1, 2)
