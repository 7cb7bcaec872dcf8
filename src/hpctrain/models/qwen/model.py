"""The Qwen decoder (Qwen2/Qwen2.5 and Qwen3): pre-norm blocks of grouped-query attention with
RoPE and a SwiGLU FFN, with q/k/v biases (``qkv_bias``) or per-head q/k RMSNorm (``qk_norm``).

Laid out as the family spec asks (``hpctrain.models.spec``): the blocks are the entries of
``blocks``, ``embed`` runs before them, ``final_norm`` and ``head`` after; a pipeline stage is
this class with the parts it does not hold set to None. Attention takes its local head count
from the projected tensor, so tensor parallelism can split the heads. RoPE rotates the two
halves of each head (Hugging Face's ``rotate_half`` order), so Hugging Face weights load as
they are stored, without reordering rows. Meta-device construction::

    with torch.device("meta"):
        model = QwenModel(args)
    model.to_empty(device=dev)
    model.init_weights()   # parameters, the RoPE table and the embedding tie
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.errors import ConfigError
from hpctrain.models.chunked_loss import chunked_linear_cross_entropy
from hpctrain.models.kv_cache import KVCache, LayerKV, causal_attention
from hpctrain.models.qwen.sizes import QwenArgs

INIT_STD = 0.02


def precompute_rope(head_dim: int, max_seq_len: int, theta: float,
                    device: torch.device | str | None = None) -> torch.Tensor:
    """The RoPE table ``[max_seq_len, head_dim // 2, 2]``: (cos, sin) per position and
    frequency, in float32 (the same operations as Hugging Face's default rotary embedding)."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, heads, head_dim]`` by ``rope [T, head_dim // 2, 2]``: channel i pairs
    with channel i + head_dim / 2."""
    first, second = x.float().chunk(2, dim=-1)
    cos = rope[..., 0].float()[None, :, None, :]
    sin = rope[..., 1].float()[None, :, None, :]
    rotated = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return rotated.type_as(x)


def kv_cache(model: QwenModel, batch: int, max_len: int) -> KVCache:
    """An empty cache for ``batch`` sequences of at most ``max_len`` positions of ``model``."""
    args, weight = model.args, model.embed.weight
    return KVCache(args.n_layers, batch, max_len, args.n_kv_heads, args.head_dim, weight.device,
                   weight.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention with RoPE; q/k/v biases or q/k norms by the shape."""

    def __init__(self, args: QwenArgs):
        super().__init__()
        self.head_dim = args.head_dim
        q_dim, kv_dim = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.q = nn.Linear(args.dim, q_dim, bias=args.qkv_bias)
        self.k = nn.Linear(args.dim, kv_dim, bias=args.qkv_bias)
        self.v = nn.Linear(args.dim, kv_dim, bias=args.qkv_bias)
        self.o = nn.Linear(q_dim, args.dim, bias=False)
        # Over each head's channels, one weight shared by all heads. Without them (Qwen2) an
        # identity holds their place, so that the tensor-parallel plan is one for both.
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm \
            else nn.Identity()
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm \
            else nn.Identity()

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                cache: LayerKV | None = None) -> torch.Tensor:
        """Map ``x [B, T, dim]`` to ``[B, T, dim]``, attending only to earlier positions
        (and, with ``cache``, to the cached ones; ``rope`` then starts at the first new one)."""
        bsz, seqlen, _ = x.shape
        # Sliced here, where the whole sequence is present (sequence parallelism splits it
        # between blocks).
        rope = rope[:seqlen]
        # -1, not n_heads: tensor parallelism splits the heads.
        q = self.q(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.k(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.v(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(self.q_norm(q), rope), apply_rope(self.k_norm(k), rope)
        out = causal_attention(q, k, v, cache)
        return self.o(out.reshape(bsz, seqlen, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate x) * up x)``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map ``x [..., dim]`` to ``[..., dim]``."""
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """One pre-norm decoder block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``."""

    def __init__(self, args: QwenArgs):
        super().__init__()
        self.attn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attn = Attention(args)
        self.mlp_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.mlp = MLP(args.dim, args.ffn_dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                cache: LayerKV | None = None) -> torch.Tensor:
        """Map ``x [B, T, dim]`` to ``[B, T, dim]`` given the RoPE table."""
        # The cache by keyword only: tensor parallelism prepares the positional inputs.
        attn = (self.attn(self.attn_norm(x), rope) if cache is None
                else self.attn(self.attn_norm(x), rope, cache=cache))
        h = x + attn
        return h + self.mlp(self.mlp_norm(h))


class QwenModel(nn.Module):
    """The decoder: embedding, blocks, final norm, output layer (tied to the embedding if the
    shape says so)."""

    def __init__(self, args: QwenArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.blocks = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.final_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived, never trained: kept out of checkpoints, recomputed after to_empty().
        self.register_buffer("rope", precompute_rope(args.head_dim, args.max_seq_len,
                                                     args.rope_theta), persistent=False)
        self.tie_weights()
        self.init_weights()

    def tie_weights(self) -> None:
        """Make ``head.weight`` the embedding's Parameter if the shape ties them."""
        # Again after to_empty(), which replaces each module's Parameter on its own.
        if self.args.tie_embeddings and self.head is not None and self.embed is not None:
            self.head.weight = self.embed.weight

    def init_parameter(self, name: str, tensor: torch.Tensor,
                       generator: torch.Generator | None = None) -> None:
        """Fill ``tensor``, the whole value of parameter ``name``, with its initial values (one
        rule per name, so every layout draws the same weights)."""
        if name.endswith("norm.weight"):
            nn.init.ones_(tensor)
        elif name.endswith(".bias"):
            nn.init.zeros_(tensor)
        elif name == "embed.weight":
            nn.init.normal_(tensor, mean=0.0, std=INIT_STD, generator=generator)
        else:
            # The residual branches' output projections scaled by 1/sqrt(2 * n_layers) (GPT-2):
            # the stream's variance at init does not grow with depth.
            std = INIT_STD / math.sqrt(2 * self.args.n_layers) if name.endswith(
                ("attn.o.weight", "mlp.down.weight")) else INIT_STD
            nn.init.trunc_normal_(tensor, mean=0.0, std=std, a=-3 * std, b=3 * std,
                                  generator=generator)

    def init_buffers(self) -> None:
        """Recompute the RoPE table on its current device and restore the embedding tie."""
        self.tie_weights()
        with torch.no_grad():
            self.rope.copy_(precompute_rope(self.args.head_dim, self.args.max_seq_len,
                                            self.args.rope_theta, device=self.rope.device))

    def init_weights(self) -> None:
        """(Re)initialise every parameter and the RoPE table in place (deterministic given
        the global RNG seed)."""
        self.init_buffers()
        with torch.no_grad():
            for name, param in self.named_parameters():
                self.init_parameter(name, param)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, *,
                targets: torch.Tensor | None = None, loss_chunks: int = 1) -> torch.Tensor:
        """Logits ``[B, T, vocab_size]`` of token ids ``tokens [B, T]``; with ``targets`` the
        summed fp32 next-token loss instead (``hpctrain.models.chunked_loss``).

        A pipeline stage without the embedding takes the hidden state, one without the output
        layer returns it. With ``cache`` the tokens continue the cached ones.
        """
        h = tokens
        start = cache.pos if cache is not None else 0
        if self.embed is not None:
            seqlen = start + tokens.shape[1]
            if seqlen > self.rope.shape[0]:
                raise ConfigError(
                    f"sequence length {seqlen} exceeds model.max_seq_len={self.rope.shape[0]}",
                    expected=f"sequences of at most {self.rope.shape[0]} tokens",
                    hint=f"set model.max_seq_len to at least {seqlen} or shorten the sequences")
            h = self.embed(tokens)
        if cache is None:
            for block in self.blocks:
                if block is not None:
                    h = block(h, self.rope)
        else:
            if start + tokens.shape[1] > cache.max_len:
                raise ValueError(f"{start + tokens.shape[1]} positions exceed the cache's "
                                 f"{cache.max_len}")
            rope = self.rope[start:]
            for i, block in enumerate(self.blocks):
                h = block(h, rope, cache=cache.layer(i))
            cache.pos += tokens.shape[1]
        if self.final_norm is not None:
            h = self.final_norm(h)
        if targets is not None:
            if self.head is None:
                raise ValueError("targets given to a model part without the output layer")
            return chunked_linear_cross_entropy(h.flatten(0, 1), self.head.weight,
                                                targets.flatten(), loss_chunks)
        return self.head(h) if self.head is not None else h
