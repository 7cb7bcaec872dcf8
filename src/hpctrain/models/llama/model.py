"""A Llama-style decoder: pre-norm blocks of grouped-query attention with RoPE and a SwiGLU FFN.

Holds no parallelism code: `hpctrain.parallel` wraps each entry of `Transformer.layers` (the blocks
are self-contained direct children of that ModuleList). Two things keep it shardable without
knowing how: attention takes its local head count from the projected tensor (tensor parallelism
shards the heads), and a pipeline stage is this same class with the parts it does not hold set to
None (the embedding, blocks, final norm, output), so its parameters keep their canonical names.
Meta-device construction is supported::

    with torch.device("meta"):
        model = Transformer(args)
    # ... shard ...
    model.to_empty(device=dev)
    torch.manual_seed(seed)
    model.init_weights()   # parameters and the RoPE table, on whatever device they now live

For sampling, ``model(tokens, cache=kv_cache(model, batch, max_len))`` keeps each
block's keys and values, so every later call feeds only the new tokens
(``hpctrain.models.generate``). Training never passes a cache.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.errors import ConfigError
from hpctrain.models.chunked_loss import chunked_linear_cross_entropy
from hpctrain.models.kv_cache import KVCache, LayerKV, causal_attention
from hpctrain.models.llama.sizes import ModelArgs, RopeScaling

INIT_STD = 0.02


def precompute_rope(
    head_dim: int, max_seq_len: int, theta: float, device: torch.device | str | None = None,
    scaling: RopeScaling | None = None,
) -> torch.Tensor:
    """Return the RoPE table `[max_seq_len, head_dim // 2, 2]` holding (cos, sin) in float32."""
    # Real cos/sin instead of complex exponentials: complex tensors break some compile/FSDP paths.
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    if scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, scaling)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequency scaling, in the same float32 operations as Meta's and Hugging
    Face's code (so an imported model's table is bit for bit theirs)."""
    low_freq_wavelen = s.original_max_seq_len / s.low_freq_factor
    high_freq_wavelen = s.original_max_seq_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_seq_len / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate `x [B, T, heads, head_dim]` by the table `rope [T, head_dim // 2, 2]`."""
    # Adjacent channels (2i, 2i+1) form one rotated pair, as in Meta's Llama checkpoints.
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    x0, x1 = pairs.unbind(-1)
    cos = rope[..., 0].float()[None, :, None, :]
    sin = rope[..., 1].float()[None, :, None, :]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def kv_cache(model: Transformer, batch: int, max_len: int) -> KVCache:
    """An empty cache for `batch` sequences of at most `max_len` positions of `model`."""
    args, weight = model.args, model.tok_embeddings.weight
    return KVCache(args.n_layers, batch, max_len, args.n_kv_heads, args.head_dim, weight.device,
                   weight.dtype)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary position embeddings."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=args.qkv_bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=args.qkv_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                cache: LayerKV | None = None) -> torch.Tensor:
        """Map `x [B, T, dim]` to `[B, T, dim]`, attending only to earlier positions.

        ``rope`` holds at least T positions; the first T are used. With ``cache`` the T
        positions follow the cached ones: ``rope`` starts at the first new position and the
        queries attend to the cached keys too.
        """
        bsz, seqlen, _ = x.shape
        # Sliced here, where the whole sequence is present: a block's input may hold only a
        # slice of it (sequence parallelism), so the caller cannot know T.
        rope = rope[:seqlen]
        # -1 instead of n_heads so tensor parallelism can shard the heads without touching this.
        q = self.wq(x).view(bsz, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bsz, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bsz, seqlen, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        out = causal_attention(q, k, v, cache)
        return self.wo(out.reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU feed-forward: `w2(silu(w1 x) * w3 x)`."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Map `x [..., dim]` to `[..., dim]`."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """One pre-norm decoder block: `h = x + attn(norm(x)); out = h + ffn(norm(h))`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.ffn_dim)
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor,
                cache: LayerKV | None = None) -> torch.Tensor:
        """Map `x [B, T, dim]` to `[B, T, dim]` given the RoPE table (at least T positions)."""
        # The cache goes by keyword only: tensor parallelism prepares the positional inputs.
        attn = (self.attention(self.attention_norm(x), rope) if cache is None
                else self.attention(self.attention_norm(x), rope, cache=cache))
        h = x + attn
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Llama-style decoder mapping token ids `[B, T]` to next-token logits `[B, T, vocab]`."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        # Derived from args, never trained: non-persistent keeps it out of checkpoints, and
        # init_weights recomputes it after to_empty() leaves it uninitialised.
        self.register_buffer(
            "rope",
            precompute_rope(args.head_dim, args.max_seq_len, args.rope_theta,
                            scaling=args.rope_scaling),
            persistent=False,
        )
        self.tie_weights()
        self.init_weights()

    def tie_weights(self) -> None:
        """Make `output.weight` the same Parameter as `tok_embeddings.weight` if tying is on."""
        # Needed again after to_empty(): it replaces each module's Parameter separately, which
        # silently unties shared weights.
        if self.args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def init_parameter(
        self, name: str, tensor: torch.Tensor, generator: torch.Generator | None = None
    ) -> None:
        """Fill ``tensor``, the full value of parameter ``name``, with its initial values.

        One rule per parameter name, so a caller can initialise a parameter whole and keep only
        its shard (``hpctrain.parallel.materialize``) and get the same weights on any layout.
        """
        module = name.rsplit(".", 2)[-2] if "." in name else name
        if name.endswith("norm.weight"):
            nn.init.ones_(tensor)
        elif name.endswith(".bias"):
            nn.init.zeros_(tensor)
        elif name == "tok_embeddings.weight":
            nn.init.normal_(tensor, mean=0.0, std=INIT_STD, generator=generator)
        elif module in ("wo", "w2"):
            # Each block adds two residual branches, so the stream sums 2 * n_layers of them;
            # scaling the branch output projections by 1/sqrt(2 * n_layers) (GPT-2) keeps the
            # residual stream's variance at init independent of depth.
            _trunc_normal_(tensor, INIT_STD / math.sqrt(2 * self.args.n_layers), generator)
        else:
            _trunc_normal_(tensor, INIT_STD, generator)

    def init_buffers(self) -> None:
        """Recompute the RoPE table on its current device and restore weight tying."""
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.tie_weights()
        with torch.no_grad():
            self.rope.copy_(
                precompute_rope(
                    self.args.head_dim,
                    self.args.max_seq_len,
                    self.args.rope_theta,
                    device=self.rope.device,
                    scaling=self.args.rope_scaling,
                )
            )

    def init_weights(self) -> None:
        """(Re)initialise all parameters and the RoPE table in place, on their current device.

        Deterministic given the global RNG seed set by the caller. For sharded parameters use
        ``hpctrain.parallel.materialize``, which gives the same values on any number of ranks.
        """
        self.init_buffers()
        with torch.no_grad():
            for name, param in self.named_parameters():
                self.init_parameter(name, param)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, *,
                targets: torch.Tensor | None = None, loss_chunks: int = 1) -> torch.Tensor:
        """Return logits `[B, T, vocab_size]` for token ids `tokens [B, T]`.

        A pipeline stage without the embedding takes the hidden state `[B, T, dim]` instead,
        and one without the output layer returns the hidden state. With ``cache`` the tokens
        continue the ones cached, whose keys and values are reused, and are added to it.

        With ``targets [B, T]`` it returns the summed fp32 next-token cross entropy instead
        (``IGNORE_INDEX`` targets add 0), computed with the output layer over ``loss_chunks``
        token chunks so the whole logits never exist (``hpctrain.models.chunked_loss``).
        """
        h = tokens
        start = cache.pos if cache is not None else 0
        if self.tok_embeddings is not None:
            seqlen = start + tokens.shape[1]
            if seqlen > self.rope.shape[0]:
                raise ConfigError(
                    f"sequence length {seqlen} exceeds model.max_seq_len={self.rope.shape[0]}",
                    expected=f"sequences of at most {self.rope.shape[0]} tokens",
                    hint=f"set model.max_seq_len to at least {seqlen} or shorten the sequences",
                )
            h = self.tok_embeddings(tokens)
        if cache is None:
            for layer in self.layers:
                if layer is not None:
                    h = layer(h, self.rope)
        else:
            if start + tokens.shape[1] > cache.max_len:
                raise ValueError(f"{start + tokens.shape[1]} positions exceed the cache's "
                                 f"{cache.max_len}")
            rope = self.rope[start:]
            for i, layer in enumerate(self.layers):
                h = layer(h, rope, cache=cache.layer(i))
            cache.pos += tokens.shape[1]
        if self.norm is not None:
            h = self.norm(h)
        if targets is not None:
            if self.output is None:
                raise ValueError("targets given to a model part without the output layer")
            # Here, inside forward, a sharding wrapper has gathered the whole output weight.
            return chunked_linear_cross_entropy(h.flatten(0, 1), self.output.weight,
                                                targets.flatten(), loss_chunks)
        return self.output(h) if self.output is not None else h


def _trunc_normal_(
    weight: torch.Tensor, std: float, generator: torch.Generator | None = None
) -> None:
    """Fill `weight` in place from N(0, std) truncated at ±3 std."""
    nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=generator)
